//! `multipart/form-data` bodies (RFC 7578) as `POST /v1/voices` receives them, read with the
//! `multer` crate. The body is bounded and read whole before (`http::read_body`), so the form
//! is read from memory.

use bytes::Bytes;

/// The longest field name accepted (bytes): names are echoed in error messages.
pub const MAX_FIELD_NAME: usize = 256;

/// One form field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Bytes,
}

/// The boundary of a `Content-Type: multipart/form-data; boundary=…` header value.
pub fn boundary(content_type: &str) -> Option<String> {
    multer::parse_boundary(content_type)
        .ok()
        .filter(|b| !b.is_empty() && b.len() <= 200)
}

/// The parts of `body`, or what is wrong with it.
pub async fn parse(body: Bytes, boundary: String) -> Result<Vec<Part>, String> {
    let body = std::iter::once(Ok::<Bytes, std::convert::Infallible>(body));
    let mut form = multer::Multipart::new(futures_util::stream::iter(body), boundary);
    let mut parts = Vec::new();
    let malformed = |e: multer::Error| format!("malformed multipart body: {e}");
    while let Some(field) = form.next_field().await.map_err(malformed)? {
        let name = field
            .name()
            .ok_or("a multipart part has no name")?
            .to_string();
        if name.len() > MAX_FIELD_NAME {
            return Err(format!(
                "a multipart field name is longer than {MAX_FIELD_NAME} bytes"
            ));
        }
        let filename = field.file_name().map(str::to_string);
        let content_type = field.content_type().map(|m| m.to_string());
        let data = field.bytes().await.map_err(malformed)?;
        parts.push(Part {
            name,
            filename,
            content_type,
            data,
        });
    }
    if parts.is_empty() {
        return Err("the multipart body has no parts".into());
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_now(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(parse(Bytes::copy_from_slice(body), boundary.to_string()))
    }

    #[test]
    fn parses_fields_and_files() {
        let b = "XyZ";
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"transcript\"\r\n\r\nHello there.\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--X\x00\r\n--XyZ--\r\n";
        let parts = parse_now(body, b).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "transcript");
        assert_eq!(parts[0].data, &b"Hello there."[..]);
        assert_eq!(parts[1].filename.as_deref(), Some("a.wav"));
        assert_eq!(parts[1].content_type.as_deref(), Some("audio/wav"));
        assert_eq!(parts[1].data, &b"RIFF\r\n--X\x00"[..]);
        assert_eq!(
            boundary("multipart/form-data; boundary=\"XyZ\"").as_deref(),
            Some("XyZ")
        );
        assert_eq!(boundary("application/json"), None);
        assert_eq!(boundary("multipart/mixed; boundary=XyZ"), None);
    }

    #[test]
    fn field_names_are_bounded() {
        let part = |name: &str| {
            format!("--B\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\nx\r\n--B--\r\n")
        };
        assert_eq!(parse_now(part("ok").as_bytes(), "B").unwrap()[0].name, "ok");
        let e = parse_now(part(&"n".repeat(MAX_FIELD_NAME + 1)).as_bytes(), "B").unwrap_err();
        assert!(e.contains("longer than 256 bytes"), "{e}");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(parse_now(b"no boundary here", "XyZ").is_err());
        assert!(parse_now(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nopen",
            "XyZ"
        )
        .is_err());
        assert!(parse_now(
            b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx\r\n--XyZ--",
            "XyZ"
        )
        .is_err());
    }
}
