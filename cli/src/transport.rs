//! What a command dialled — sbxd's Unix socket, plain HTTP/2 over TCP, or TLS over TCP — and
//! what that says about a failure. A TLS handshake that fails on an unknown CA, or plain HTTP/2
//! sent to a TLS listener, reads as a bare transport error; the hint that names the flag that
//! mends it can only be given by one who knows how the gateway was dialled.
//!
//! That knowledge is data ([`Transport`]): a target says which one it dials
//! (`connect::Address::transport`), and whoever turns a failure into words is handed it
//! (`error::describe_status`, `CliError::message`). It used to be two process-global flags
//! that the dial set, so the words of an error depended on whatever the process had dialled
//! before. This module is a leaf: `connect` and `error` both use it, neither is used by it.

/// How the gateway was dialled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// sbxd's Unix socket: no TLS, no hint about it.
    Unix,
    /// Plain HTTP/2 over TCP (`http://`, or a bare `host:port` without TLS settings).
    Tcp,
    /// TLS over TCP (`https://`, or a bare `host:port` with TLS settings).
    Tls,
}

impl Transport {
    /// Whether it is TCP (with TLS or without), not the socket.
    pub fn is_tcp(self) -> bool {
        matches!(self, Transport::Tcp | Transport::Tls)
    }
}

/// What a failed TCP dial most likely means and the flag that mends it, from the words of
/// the error (`cause`) and whether TLS was dialed: a CA sbx does not trust, a name the
/// certificate lacks, TLS to a plain listener, or plain HTTP/2 to a TLS one.
pub fn tcp_mismatch_hint(cause: &str, tls: bool) -> Option<&'static str> {
    let said = |words: &[&str]| words.iter().any(|w| cause.contains(w));
    if tls && said(&["UnknownIssuer", "unknown issuer", "UnknownCA"]) {
        Some(
            "the gateway's certificate is signed by a CA sbx does not trust: pass that CA with \
             --tls-ca; sbxd certs init writes it as ca.pem",
        )
    } else if tls && said(&["NotValidForName", "not valid for name"]) {
        Some(
            "the gateway's certificate does not name the host dialed: dial a name it has, as \
             sbxd certs init --name gave them, or set --tls-server-name",
        )
    } else if tls
        && said(&[
            "InvalidContentType",
            "corrupt message",
            "invalid message",
            "WrongVersion",
            "wrong version",
        ])
    {
        Some(
            "the gateway does not speak TLS there: dial http://HOST:PORT without the --tls \
             flags, or start sbxd with --tls-cert and --tls-key",
        )
    } else if !tls && said(&["h2 protocol error", "frame with invalid size"]) {
        Some(
            "the gateway may expect TLS there: dial https://HOST:PORT with --tls-ca and the CA \
             that signed its certificate",
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words each mismatch was seen to give here (`sbx` against sbxd, both ways), the
    /// flag each hint must name, and one line of plain words.
    #[test]
    fn each_mismatch_names_its_flag() {
        for (cause, tls, flag) in [
            ("h2 protocol error: http2 error", false, "https://"),
            (
                "transport error: received corrupt message of type InvalidContentType",
                true,
                "http://",
            ),
            (
                "transport error: invalid peer certificate: UnknownIssuer",
                true,
                "--tls-ca",
            ),
            (
                "invalid peer certificate: NotValidForName",
                true,
                "--tls-server-name",
            ),
        ] {
            let hint = tcp_mismatch_hint(cause, tls).unwrap_or_else(|| panic!("none for {cause}"));
            assert!(hint.contains(flag), "{cause}: {hint}");
            assert!(!hint.contains("  ") && !hint.contains('\n'), "{hint:?}");
        }
        // A refused connection is not a mismatch.
        let refused = "tcp connect error: Connection refused (os error 111)";
        assert_eq!(tcp_mismatch_hint(refused, true), None);
        assert_eq!(tcp_mismatch_hint(refused, false), None);
    }
}
