//! Image references: the naming rule of images, applied by the CLI, the actor API and the store.
//!
//! A reference is `[domain/]path[:tag][@sha256:<64 hex>]` by the grammar of the OCI
//! distribution reference (github.com/distribution/reference): path components are lowercase
//! letters and digits joined by `.`, `_`, `__` or runs of `-`; a tag is 1 to 128 of
//! `[A-Za-z0-9_.-]` not starting with `.` or `-`; the whole name (domain and path) is at most
//! 255 bytes. The first component is a domain when it holds a `.` or a `:` or is `localhost`;
//! otherwise the domain is `docker.io`, whose single-component paths live under `library/`.
//!
//! An image record's name is the *normalised* form of a reference without digest:
//! `domain/path:tag` (tag `latest` when none is given), so `busybox` and
//! `docker.io/library/busybox:latest` name the same record.

use std::fmt;

/// The domain of references that name none.
pub const DEFAULT_DOMAIN: &str = "docker.io";
/// The tag of references that name none.
pub const DEFAULT_TAG: &str = "latest";
/// The longest name (domain and path), in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// The longest tag, in bytes.
pub const MAX_TAG_LEN: usize = 128;

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageReference {
    /// `docker.io`, `localhost:5000`, `sbx.local`…
    pub domain: String,
    /// `library/busybox`, `team/app`…
    pub path: String,
    /// `None` when the reference names no tag.
    pub tag: Option<String>,
    /// `sha256:<hex>` when the reference pins a digest.
    pub digest: Option<String>,
}

/// Why a reference was refused. Each names the reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRefError {
    pub reference: String,
    pub reason: String,
}

impl fmt::Display for ImageRefError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "image reference {:?} is invalid: {}",
            self.reference, self.reason
        )
    }
}

impl std::error::Error for ImageRefError {}

impl ImageReference {
    /// The normalised name without digest: `domain/path:tag` (tag `latest` if none).
    pub fn name(&self) -> String {
        format!(
            "{}/{}:{}",
            self.domain,
            self.path,
            self.tag.as_deref().unwrap_or(DEFAULT_TAG)
        )
    }
}

/// Whether `text` is a bare manifest digest, `sha256:` and 64 lowercase hex digits.
pub fn is_digest(text: &str) -> bool {
    text.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Parses and normalises a reference (see the module docs).
pub fn parse(reference: &str) -> Result<ImageReference, ImageRefError> {
    let fail = |reason: String| ImageRefError {
        reference: reference.to_string(),
        reason,
    };
    if reference.is_empty() {
        return Err(fail("it is empty".into()));
    }
    let (rest, digest) = match reference.split_once('@') {
        Some((rest, digest)) => {
            if !is_digest(digest) {
                return Err(fail(format!(
                    "the digest {digest:?} is not sha256: and 64 lowercase hex digits"
                )));
            }
            (rest, Some(digest.to_string()))
        }
        None => (reference, None),
    };
    // A tag follows the last ':' that comes after the last '/' (a ':' before it is a port).
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => {
            let at = last_slash + i;
            (&rest[..at], Some(rest[at + 1..].to_string()))
        }
        None => (rest, None),
    };
    if let Some(tag) = &tag {
        check_tag(tag).map_err(fail)?;
    }
    if name.is_empty() {
        return Err(fail("the name before the tag or digest is empty".into()));
    }
    let (domain, path) = match name.split_once('/') {
        Some((first, path))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            check_domain(first).map_err(fail)?;
            (first.to_string(), path.to_string())
        }
        _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
    };
    let domain = if domain == "index.docker.io" {
        DEFAULT_DOMAIN.to_string()
    } else {
        domain
    };
    let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
        format!("library/{path}")
    } else {
        path
    };
    for component in path.split('/') {
        check_path_component(component).map_err(fail)?;
    }
    if domain.len() + 1 + path.len() > MAX_NAME_LEN {
        return Err(fail(format!(
            "the name is over {MAX_NAME_LEN} bytes once normalised"
        )));
    }
    Ok(ImageReference {
        domain,
        path,
        tag,
        digest,
    })
}

/// The rule of an image record's name: a reference already in its normalised form
/// (`domain/path:tag`), without digest.
pub fn validate_image_name(name: &str) -> Result<(), ImageRefError> {
    let parsed = parse(name)?;
    let normal = parsed.name();
    if parsed.digest.is_some() || normal != name {
        return Err(ImageRefError {
            reference: name.to_string(),
            reason: format!("an image name is a normalised reference without digest ({normal:?})"),
        });
    }
    Ok(())
}

fn check_tag(tag: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-';
    if tag.is_empty() || tag.len() > MAX_TAG_LEN {
        return Err(format!("the tag {tag:?} is not 1 to {MAX_TAG_LEN} bytes"));
    }
    if tag.starts_with(['.', '-']) || !tag.chars().all(ok_char) {
        return Err(format!(
            "the tag {tag:?} is not [A-Za-z0-9_.-] starting with a letter, digit or '_'"
        ));
    }
    Ok(())
}

fn check_domain(domain: &str) -> Result<(), String> {
    let (host, port) = match domain.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (domain, None),
    };
    if let Some(port) = port
        && (port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!("the port of domain {domain:?} is not a number"));
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !host.split('.').all(label_ok) {
        return Err(format!(
            "the domain {domain:?} is not host[:port] of dot-separated letters, digits and '-'"
        ));
    }
    Ok(())
}

fn check_path_component(component: &str) -> Result<(), String> {
    let bad = || {
        format!(
            "the path component {component:?} is not lowercase letters and digits joined by '.', '_', '__' or '-'"
        )
    };
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = component.as_bytes();
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return Err(bad());
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        // A separator: '.', '_', '__' or a run of '-', followed by a letter or digit.
        let start = i;
        match bytes[i] {
            b'.' => i += 1,
            b'_' => {
                i += if bytes.get(i + 1) == Some(&b'_') {
                    2
                } else {
                    1
                }
            }
            b'-' => {
                while bytes.get(i) == Some(&b'-') {
                    i += 1;
                }
            }
            _ => return Err(bad()),
        }
        if i == start || !bytes.get(i).copied().is_some_and(alnum) {
            return Err(bad());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn normalises_docker_hub_names() {
        for (given, normal) in [
            ("busybox", "docker.io/library/busybox:latest"),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("team/app", "docker.io/team/app:latest"),
            ("docker.io/busybox", "docker.io/library/busybox:latest"),
            (
                "index.docker.io/library/busybox:x",
                "docker.io/library/busybox:x",
            ),
            ("localhost/app", "localhost/app:latest"),
            ("localhost:5000/a/b:v1", "localhost:5000/a/b:v1"),
            ("127.0.0.1:5000/app", "127.0.0.1:5000/app:latest"),
            ("sbx.local/busybox:latest", "sbx.local/busybox:latest"),
            (
                "ghcr.io/a__b/c-d--e.f:V_1.0-x",
                "ghcr.io/a__b/c-d--e.f:V_1.0-x",
            ),
        ] {
            assert_eq!(parse(given).unwrap().name(), normal, "{given}");
        }
    }

    #[test]
    fn keeps_the_digest_and_the_port() {
        let r = parse(&format!("localhost:5000/app:v1@{DIGEST}")).unwrap();
        assert_eq!(r.domain, "localhost:5000");
        assert_eq!(r.path, "app");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.digest.as_deref(), Some(DIGEST));
        let r = parse(&format!("busybox@{DIGEST}")).unwrap();
        assert_eq!(r.tag, None);
        assert_eq!(r.digest.as_deref(), Some(DIGEST));
    }

    #[test]
    fn refuses_malformed_references_naming_them() {
        for bad in [
            "",
            "Busybox",
            "busybox:",
            "busybox:-x",
            "busybox:.x",
            "a//b",
            "a/",
            "/a",
            "a..b",
            "a___b",
            "a-",
            "-a",
            "a b",
            "localhost:port/app",
            "ex-.com/app",
            "busybox@sha256:abc",
            "busybox@md5:0123",
            "@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            let err = parse(bad).expect_err(bad);
            assert_eq!(err.reference, bad);
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        assert!(parse(&"a".repeat(256)).is_err());
        assert!(parse(&format!("a:{}", "t".repeat(129))).is_err());
        assert!(parse(&format!("a:{}", "t".repeat(128))).is_ok());
    }

    #[test]
    fn digests() {
        assert!(is_digest(DIGEST));
        assert!(!is_digest(&DIGEST.to_uppercase()));
        assert!(!is_digest(&DIGEST[..70]));
        assert!(!is_digest("sha512:00"));
    }

    #[test]
    fn record_names_are_normalised_references_without_digest() {
        assert!(validate_image_name("docker.io/library/busybox:latest").is_ok());
        assert!(validate_image_name("sbx.local/busybox:latest").is_ok());
        for bad in [
            "busybox",
            "docker.io/library/busybox",
            "docker.io/busybox:latest",
            &format!("docker.io/library/busybox:latest@{DIGEST}"),
            DIGEST,
            "",
        ] {
            assert!(validate_image_name(bad).is_err(), "{bad}");
        }
    }
}
