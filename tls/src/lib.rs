//! TLS for the gateway: the server's and the CLI's tonic TLS configurations from PEM files, and
//! the identity of a client that presented a verified certificate (mutual TLS).
//!
//! Why a module of its own: tonic reads PEM lazily and its errors say neither which file nor
//! what is wrong ("Error parsing TLS certificate."), a client CA file without a certificate in
//! it is accepted silently (every client is then refused), and a key that belongs to another
//! certificate only shows up at the first handshake. Here every file is read and checked when
//! the configuration is made, and every [`TlsError`] names the file and the problem.
//!
//! Crypto provider: the dependency tree enables both of rustls's providers (ring here,
//! aws-lc-rs through the registry client), so rustls cannot pick one by itself and tonic's
//! server would panic; [`server_config`] and [`client_config`] install ring as the process
//! default first (once; a provider installed earlier by someone else is kept).
//!
//! Peer identity: tonic puts a [`TlsConnectInfo<TcpConnectInfo>`] into the extensions of every
//! request of a TLS connection; its peer certificates are there only when the server's client
//! verifier accepted them (chain to the client CA, clientAuth usage, validity), so their subject
//! common name is the authenticated client. Handlers and interceptors call [`peer_identity`];
//! a tower layer (it sees `http::Request`s) calls [`peer_identity_http`]; both read the same
//! extension through [`peer_identity_in`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{PemObject, SectionKind};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// How long the server waits for a client's TLS handshake. tonic runs handshakes concurrently
/// but, without a limit, keeps a connection that never completes one (and its task) forever;
/// a handshake takes one or two round trips, milliseconds on any network a CLI is used over.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong making a TLS configuration; each names the file (or name) it is about.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {what} {} is not PEM: {reason}", path.display())]
    NotPem {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("the {what} {} holds no certificate (no \"BEGIN CERTIFICATE\" block; {found})", path.display())]
    NoCertificate {
        what: &'static str,
        path: PathBuf,
        found: String,
    },
    #[error("the {what} {} holds no private key (no \"BEGIN PRIVATE KEY\", \"BEGIN EC PRIVATE KEY\" or \"BEGIN RSA PRIVATE KEY\" block; {found})", path.display())]
    NoKey {
        what: &'static str,
        path: PathBuf,
        found: String,
    },
    #[error("the {what} {} holds a certificate that cannot be parsed: {reason}", path.display())]
    BadCertificate {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("the {what} {} has expired (not valid after {not_after})", path.display())]
    Expired {
        what: &'static str,
        path: PathBuf,
        not_after: String,
    },
    #[error("the {what} {} cannot be used: {reason}", path.display())]
    BadKey {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("the key {} does not belong to the certificate {} (their public keys differ)", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("the TLS server name {name:?} is neither a DNS name nor an IP address")]
    BadServerName { name: String },
}

/// The server's configuration: its certificate chain `cert` and private key `key` (PEM
/// files), handshakes bounded by [`HANDSHAKE_TIMEOUT`]. With `client_ca`, mutual TLS: every client must present a certificate signed by
/// that CA (PEM, one or more certificates), or the handshake fails.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerTlsConfig, TlsError> {
    let provider = crypto_provider();
    let (cert_pem, key_pem) = checked_identity(cert, key, "TLS certificate", "TLS key", &provider)?;
    let mut config = ServerTlsConfig::new()
        .identity(Identity::from_pem(cert_pem, key_pem))
        .timeout(HANDSHAKE_TIMEOUT);
    if let Some(ca) = client_ca {
        let ca_pem = read_pem(ca, "client CA")?;
        certificates(ca, "client CA", &ca_pem)?;
        config = config.client_ca_root(Certificate::from_pem(ca_pem));
    }
    Ok(config)
}

/// The CLI's configuration: the CA that signed the server's certificate (`ca`; without it the
/// system's trusted roots), a client certificate and key for mutual TLS (`identity`: cert,
/// key), and `domain`, the name the server's certificate must be valid for when it is not
/// the host of the address dialed.
pub fn client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
    domain: Option<&str>,
) -> Result<ClientTlsConfig, TlsError> {
    let provider = crypto_provider();
    let mut config = ClientTlsConfig::new();
    config = match ca {
        Some(ca) => {
            let ca_pem = read_pem(ca, "CA certificate")?;
            certificates(ca, "CA certificate", &ca_pem)?;
            config.ca_certificate(Certificate::from_pem(ca_pem))
        }
        None => config.with_native_roots(),
    };
    if let Some((cert, key)) = identity {
        let (cert_pem, key_pem) =
            checked_identity(cert, key, "client certificate", "client key", &provider)?;
        config = config.identity(Identity::from_pem(cert_pem, key_pem));
    }
    if let Some(domain) = domain {
        if ServerName::try_from(domain).is_err() {
            return Err(TlsError::BadServerName {
                name: domain.to_owned(),
            });
        }
        config = config.domain_name(domain);
    }
    Ok(config)
}

/// The subject common name of the client certificate verified on this request's connection
/// (mutual TLS); `None` without TLS, without a client certificate, or without a common name.
/// For handlers and interceptors; a tower layer calls [`peer_identity_http`].
pub fn peer_identity<T>(req: &tonic::Request<T>) -> Option<String> {
    peer_identity_in(req.extensions())
}

/// [`peer_identity`] for a tower layer in front of the tonic services (`Server::layer`), which
/// sees `http::Request`s: tonic inserts the connection's info before any layer runs.
pub fn peer_identity_http<B>(req: &tonic::codegen::http::Request<B>) -> Option<String> {
    peer_identity_in(req.extensions())
}

/// The common name of the first (the client's own) certificate in the connection info that
/// tonic leaves in the request's extensions.
pub fn peer_identity_in(extensions: &tonic::Extensions) -> Option<String> {
    let certs = extensions
        .get::<TlsConnectInfo<TcpConnectInfo>>()?
        .peer_certs()?;
    common_name(certs.first()?)
}

/// The subject common name of a DER certificate (the first one when there are several).
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
}

/// A plain rustls client configuration that trusts only the CA certificates in `ca` (PEM,
/// each checked as for the other configurations), for clients other than gRPC ones (the
/// PostgreSQL store's connections).
pub fn rustls_client_config(ca: &Path) -> Result<rustls::ClientConfig, TlsError> {
    let provider = crypto_provider();
    let pem = read_pem(ca, "CA certificate")?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca, "CA certificate", &pem)? {
        roots.add(cert).map_err(|e| TlsError::BadCertificate {
            what: "CA certificate",
            path: ca.to_owned(),
            reason: e.to_string(),
        })?;
    }
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::BadCertificate {
            what: "CA certificate",
            path: ca.to_owned(),
            reason: e.to_string(),
        })
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
}

/// A plain rustls server configuration presenting `cert` with `key` (checked as for
/// [`server_config`]), speaking HTTP/1.1 (ALPN), for HTTP listeners other than gRPC's (the
/// E2B API's).
pub fn rustls_server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    let provider = crypto_provider();
    let (cert_pem, key_pem) = checked_identity(cert, key, "TLS certificate", "TLS key", &provider)?;
    let chain = certificates(cert, "TLS certificate", &cert_pem)?;
    let private_key = private_key(key, "TLS key", &key_pem)?;
    let bad = |reason: String| TlsError::BadKey {
        what: "TLS key",
        path: key.to_owned(),
        reason,
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(|e| bad(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// ring, installed as the process's default provider unless one is installed already.
fn crypto_provider() -> Arc<CryptoProvider> {
    if CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: theirs is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// Reads a certificate and its key, checks both, and that the key is the certificate's;
/// returns the two files' bytes.
fn checked_identity(
    cert: &Path,
    key: &Path,
    cert_what: &'static str,
    key_what: &'static str,
    provider: &CryptoProvider,
) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let cert_pem = read_pem(cert, cert_what)?;
    let chain = certificates(cert, cert_what, &cert_pem)?;
    let key_pem = read_pem(key, key_what)?;
    let private_key = private_key(key, key_what, &key_pem)?;
    match CertifiedKey::from_der(chain, private_key, provider) {
        Ok(_) => Ok((cert_pem, key_pem)),
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsError::KeyMismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
        }),
        Err(e) => Err(TlsError::BadKey {
            what: key_what,
            path: key.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// A file's bytes, checked to be PEM: at least one well-formed block.
fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })?;
    let not_pem = |reason: String| TlsError::NotPem {
        what,
        path: path.to_owned(),
        reason,
    };
    let mut blocks = 0usize;
    for section in <(SectionKind, Vec<u8>)>::pem_slice_iter(&bytes) {
        section.map_err(|e| not_pem(e.to_string()))?;
        blocks += 1;
    }
    if blocks == 0 {
        return Err(not_pem(format!(
            "no \"-----BEGIN ...-----\" block in its {} bytes",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// The kinds of the PEM blocks in `pem`, for an error saying what was found instead.
fn kinds_found(pem: &[u8]) -> String {
    let kinds: Vec<String> = <(SectionKind, Vec<u8>)>::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .map(|(kind, _)| format!("{kind:?}"))
        .collect();
    format!("found: {}", kinds.join(", "))
}

/// The certificates of a PEM file that has at least one, each parsed and within its validity.
fn certificates(
    path: &Path,
    what: &'static str,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_owned(),
            found: kinds_found(pem),
        });
    }
    for cert in &certs {
        let (_, parsed) =
            x509_parser::parse_x509_certificate(cert).map_err(|e| TlsError::BadCertificate {
                what,
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        let not_after = parsed.validity().not_after;
        if not_after < x509_parser::time::ASN1Time::now() {
            return Err(TlsError::Expired {
                what,
                path: path.to_owned(),
                not_after: not_after.to_string(),
            });
        }
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, SEC1 or PKCS#1).
fn private_key(
    path: &Path,
    what: &'static str,
    pem: &[u8],
) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|_| TlsError::NoKey {
        what,
        path: path.to_owned(),
        found: kinds_found(pem),
    })
}
