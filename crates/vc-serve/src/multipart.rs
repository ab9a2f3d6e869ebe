//! `multipart/form-data` bodies (RFC 7578) as `POST /v1/voices` receives them: the whole body
//! is in memory (its size is bounded before it is read), so parsing is a scan for boundaries.

/// The longest header block of one part accepted (bytes): a part's headers are a few short
/// lines, and their values (the field name) are echoed in error messages.
pub const MAX_PART_HEAD: usize = 8192;

/// One form field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Vec<u8>,
}

/// The boundary of a `Content-Type: multipart/form-data; boundary=…` header value.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    let kind = parts.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts.find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_string())
            .filter(|b| !b.is_empty() && b.len() <= 200)
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

/// A `name="value"` parameter of a header value (quoted or not).
fn param(value: &str, key: &str) -> Option<String> {
    value.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case(key)
            .then(|| v.trim().trim_matches('"').to_string())
    })
}

/// The parts of `body`, or what is wrong with it.
pub fn parse(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
    let delim = format!("--{boundary}");
    let delim = delim.as_bytes();
    let mut pos = find(body, delim, 0).ok_or("the body has no multipart boundary")?;
    let mut parts = Vec::new();
    loop {
        pos += delim.len();
        if body[pos..].starts_with(b"--") {
            return Ok(parts);
        }
        if !body[pos..].starts_with(b"\r\n") {
            return Err("a multipart boundary is not followed by a line break".into());
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("a multipart part has no header end")?;
        if head_end - pos > MAX_PART_HEAD {
            return Err(format!(
                "a multipart part's headers are longer than {MAX_PART_HEAD} bytes"
            ));
        }
        let head = std::str::from_utf8(&body[pos..head_end])
            .map_err(|_| "a multipart part header is not UTF-8")?;
        let mut name = None;
        let mut filename = None;
        let mut content_type = None;
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                return Err(format!("bad multipart header line {line:?}"));
            };
            let k = k.trim();
            if k.eq_ignore_ascii_case("content-disposition") {
                if !v.trim().to_ascii_lowercase().starts_with("form-data") {
                    return Err("a multipart part is not form-data".into());
                }
                name = param(v, "name");
                filename = param(v, "filename");
            } else if k.eq_ignore_ascii_case("content-type") {
                content_type = Some(v.trim().to_string());
            }
        }
        let data_start = head_end + 4;
        let mut close = Vec::with_capacity(delim.len() + 2);
        close.extend_from_slice(b"\r\n");
        close.extend_from_slice(delim);
        let data_end = find(body, &close, data_start).ok_or("a multipart part is not closed")?;
        parts.push(Part {
            name: name.ok_or("a multipart part has no name")?,
            filename,
            content_type,
            data: body[data_start..data_end].to_vec(),
        });
        pos = data_end + 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_and_files() {
        let b = "XyZ";
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"transcript\"\r\n\r\nHello there.\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--X\x00\r\n--XyZ--\r\n";
        let parts = parse(body, b).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "transcript");
        assert_eq!(parts[0].data, b"Hello there.");
        assert_eq!(parts[1].filename.as_deref(), Some("a.wav"));
        assert_eq!(parts[1].content_type.as_deref(), Some("audio/wav"));
        assert_eq!(parts[1].data, b"RIFF\r\n--X\x00");
        assert_eq!(
            boundary("multipart/form-data; boundary=\"XyZ\"").as_deref(),
            Some("XyZ")
        );
        assert_eq!(boundary("application/json"), None);
    }

    #[test]
    fn part_headers_are_bounded() {
        let part = |name: &str| {
            format!("--B\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\nx\r\n--B--\r\n")
        };
        assert_eq!(parse(part("ok").as_bytes(), "B").unwrap()[0].name, "ok");
        let e = parse(part(&"n".repeat(MAX_PART_HEAD)).as_bytes(), "B").unwrap_err();
        assert!(e.contains("longer than 8192 bytes"), "{e}");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(parse(b"no boundary here", "XyZ").is_err());
        assert!(parse(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nopen",
            "XyZ"
        )
        .is_err());
        assert!(parse(
            b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx\r\n--XyZ--",
            "XyZ"
        )
        .is_err());
    }
}
