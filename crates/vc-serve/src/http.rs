//! HTTP plumbing of the API: the response body types, OpenAI-style errors, bounded body reads.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::{Response, StatusCode};

/// Error of a streamed body (the stream failed after it began: the connection is aborted).
#[derive(Debug)]
pub struct StreamError(pub String);

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StreamError {}

pub type RespBody = BoxBody<Bytes, StreamError>;

pub fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into())
        .map_err(|e: Infallible| match e {})
        .boxed()
}

/// A JSON response.
pub fn json(status: StatusCode, v: &serde_json::Value) -> Response<RespBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(v.to_string()))
        .expect("static response parts")
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: Some(code),
        }
    }

    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// A 500 whose `message` the client sees as it is: it must not hold server paths.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// A 500 for a failure whose `detail` may name the server's files (a model, the
    /// workspace): the detail goes to the server's log, the client is told `what` failed only
    /// (docs/serving.md §2).
    pub fn internal_logged(what: &str, detail: impl std::fmt::Display) -> Self {
        tracing::error!("{what}: {detail}");
        Self::internal(format!("{what} (the server's log has the details)"))
    }

    pub fn response(&self) -> Response<RespBody> {
        let mut r = json(
            self.status,
            &serde_json::json!({"error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }}),
        );
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The queue frees a place when a running request ends: a few seconds.
            r.headers_mut().insert(
                "retry-after",
                hyper::header::HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                "www-authenticate",
                hyper::header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

/// What a 429 answer's `Retry-After` says, in seconds.
pub const RETRY_AFTER_SECONDS: &str = "2";

/// Counts the streams being sent; the shutdown waits for it to reach 0.
#[derive(Debug, Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A streamed response body fed by a request's decode worker. Dropping it (the client went
/// away, or the response finished) sets `cancel`, which frees the request's batch row.
pub struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, StreamError>>,
    cancel: Arc<AtomicBool>,
    inflight: Arc<InFlight>,
}

impl ChannelBody {
    pub fn new(
        rx: tokio::sync::mpsc::Receiver<Result<Bytes, StreamError>>,
        cancel: Arc<AtomicBool>,
        inflight: Arc<InFlight>,
    ) -> Self {
        inflight.0.fetch_add(1, Ordering::SeqCst);
        ChannelBody {
            rx,
            cancel,
            inflight,
        }
    }
}

impl Drop for ChannelBody {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        self.inflight.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Reads a whole request body of at most `limit` bytes (413 beyond). A body whose declared
/// length (`Content-Length`) is already beyond the limit is refused before any of it is
/// awaited: the client need not send it, nor the server wait for it.
pub async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, ApiError>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the request body is larger than the server's limit of {limit} bytes"),
        )
    };
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    let read = http_body_util::Limited::new(body, limit).collect();
    let Ok(result) = tokio::time::timeout(super::BODY_TIMEOUT, read).await else {
        return Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!(
                "the request body did not arrive within {} s",
                super::BODY_TIMEOUT.as_secs()
            ),
        ));
    };
    match result {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(ApiError::invalid(
            None,
            "bad_body",
            format!("cannot read the request body: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that declares `0` bytes and never sends one.
    struct Declared(u64);

    impl Body for Declared {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.0)
        }
    }

    #[tokio::test]
    async fn a_declared_length_beyond_the_limit_is_refused_at_once() {
        let read = read_body(Declared(99_999_999_999), 1024);
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .expect("refused without waiting for the body");
        let e = answer.unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::PAYLOAD_TOO_LARGE, Some("request_too_large"))
        );
        // Within the limit the body is awaited (here: forever).
        let read = read_body(Declared(1024), 1024);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), read)
                .await
                .is_err()
        );
    }

    #[test]
    fn logged_internal_errors_tell_the_client_what_failed_only() {
        let e = ApiError::internal_logged("cannot register the voice", "cannot read /srv/x/model");
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            e.message.starts_with("cannot register the voice"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("/srv"), "{}", e.message);
    }
}
