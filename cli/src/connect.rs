//! Where the CLI dials and with which credential: the one place every command connects.
//!
//! sbxd listens on a Unix socket by default (`<data dir>/sbxd.sock`, mode 0600, so being the
//! socket's owner is the credential) and on TCP only when asked to (`--listen`), where a call
//! needs a bearer token or a client certificate. So an endpoint is one of
//! `unix:///abs/path` (also `unix:/abs/path`), `http://host:port`, `https://host:port`, or a
//! bare `host:port` (http, or https when TLS settings are given: sbxd's `--addr-file` writes
//! TCP addresses bare). [`connect`] dials it now (not lazily, so an unreachable gateway is
//! reported as such, with the path of a missing socket) and wraps the channel in
//! [`Credentials`], a tonic interceptor that puts `authorization: Bearer <token>` on every call
//! made through it: no command can forget the token, since the only channel a command can get
//! is the intercepted one ([`Channel`]).
//!
//! The token is a [`Token`], whose `Debug` never shows the value; errors about a token name
//! where it came from (`--token`, `SBX_TOKEN`, a context), never what it is.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{ClientTlsConfig, Endpoint, Uri};

use super::CliError;
use super::error::error_chain;
use super::transport::{Transport, tcp_mismatch_hint};

/// How long to wait for the connection to the gateway (socket or TCP, TLS, HTTP/2).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The channel every client of the CLI is built on: a connection with [`Credentials`].
pub type Channel = InterceptedService<tonic::transport::Channel, Credentials>;

/// A bearer token. Its `Debug` says `Token(<redacted>)`; the value is reached only through
/// [`Token::expose`], by the interceptor and by the config file writer.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    /// Wraps a token as given; checked when it is used ([`Credentials::new`]), so a bad one is
    /// never echoed by clap's "invalid value" message.
    pub fn new(value: impl Into<String>) -> Token {
        Token(value.into())
    }

    /// The clap value parser of `--token`: never fails (see [`Token::new`]).
    pub fn parse(value: &str) -> Result<Token, std::convert::Infallible> {
        Ok(Token::new(value))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.trim().is_empty()
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Where a setting came from, for errors and for `sbx config`: `--token`, `SBX_TOKEN`,
/// `context "prod"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag(&'static str),
    Env(&'static str),
    Context(String),
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag(flag) => f.write_str(flag),
            Source::Env(var) => f.write_str(var),
            Source::Context(name) => write!(f, "context {name:?}"),
            Source::Default => f.write_str("the default"),
        }
    }
}

/// The tonic interceptor that adds `authorization: Bearer <token>` to every call (nothing
/// without a token). Its `Debug` hides the value.
#[derive(Clone, Default)]
pub struct Credentials {
    authorization: Option<AsciiMetadataValue>,
}

impl Credentials {
    /// The header for `token`, which must be visible ASCII without spaces (what a header
    /// carries and what sbxd issues); the error names `source`, not the value.
    pub fn new(token: Option<(&Token, &Source)>) -> Result<Credentials, CliError> {
        let Some((token, source)) = token else {
            return Ok(Credentials::default());
        };
        let value = token.expose().trim();
        if let Some(position) = value.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(CliError::InvalidToken {
                source_name: source.to_string(),
                why: format!(
                    "character {} is not printable ASCII (a token is one word of visible \
                     ASCII characters)",
                    position + 1
                ),
            });
        }
        let mut header = AsciiMetadataValue::try_from(format!("Bearer {value}")).map_err(|_| {
            CliError::InvalidToken {
                source_name: source.to_string(),
                why: "it cannot be sent in a header".to_string(),
            }
        })?;
        header.set_sensitive(true);
        Ok(Credentials {
            authorization: Some(header),
        })
    }

    pub fn has_token(&self) -> bool {
        self.authorization.is_some()
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let token = if self.has_token() {
            "<redacted>"
        } else {
            "none"
        };
        write!(f, "Credentials {{ token: {token} }}")
    }
}

impl Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A parsed endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// sbxd's Unix socket, an absolute path.
    Unix(PathBuf),
    /// `http://…` or `https://…`, as tonic dials it.
    Tcp { uri: String, tls: bool },
}

impl Address {
    /// Parses `unix:///abs` or `unix:/abs`, `http://h:p`, `https://h:p`, or a bare `h:p`
    /// (https when `tls` says TLS settings were given, else http).
    pub fn parse(raw: &str, tls: bool) -> Result<Address, CliError> {
        let raw = raw.trim();
        let invalid = |cause: &str| CliError::InvalidEndpoint {
            endpoint: raw.to_string(),
            cause: cause.to_string(),
        };
        if let Some(rest) = raw.strip_prefix("unix:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if !path.starts_with('/') {
                return Err(invalid(
                    "a Unix socket endpoint names an absolute path: unix:///path/to/sbxd.sock",
                ));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if raw.is_empty() {
            return Err(invalid("it is empty"));
        }
        let address = match raw.split_once("://") {
            Some(("http", _)) => Address::Tcp {
                uri: raw.to_string(),
                tls: false,
            },
            Some(("https", _)) => Address::Tcp {
                uri: raw.to_string(),
                tls: true,
            },
            Some((scheme, _)) => {
                return Err(invalid(&format!(
                    "unknown scheme {scheme:?}: use unix://, http://, https:// or host:port"
                )));
            }
            None if tls => Address::Tcp {
                uri: format!("https://{raw}"),
                tls: true,
            },
            None => Address::Tcp {
                uri: format!("http://{raw}"),
                tls: false,
            },
        };
        Ok(address)
    }
}

impl Address {
    /// How it is dialled, which the words of a failed call depend on.
    pub fn transport(&self) -> Transport {
        match self {
            Address::Unix(_) => Transport::Unix,
            Address::Tcp { tls: false, .. } => Transport::Tcp,
            Address::Tcp { tls: true, .. } => Transport::Tls,
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix://{}", path.display()),
            Address::Tcp { uri, .. } => f.write_str(uri),
        }
    }
}

/// TLS settings for an https endpoint; files are read when dialing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// The CA that signed sbxd's certificate (PEM).
    pub ca: Option<PathBuf>,
    /// A client certificate (PEM), with `key`.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// The name to check sbxd's certificate against (default: the endpoint's host).
    pub server_name: Option<String>,
}

impl TlsSettings {
    pub fn is_empty(&self) -> bool {
        self == &TlsSettings::default()
    }
}

/// One place the default endpoint is looked for: a Unix socket, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultSocket {
    pub path: PathBuf,
    /// Whose it is, for errors and progress: "the sbx package's service".
    pub whose: &'static str,
}

impl DefaultSocket {
    /// Whether a socket is there now (a file of another kind, or nothing, is no gateway).
    pub fn is_there(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        std::fs::metadata(&self.path)
            .map(|m| m.file_type().is_socket())
            .unwrap_or(false)
    }

    /// `unix:///path (whose)`.
    pub fn shown(&self) -> String {
        format!("unix://{} ({})", self.path.display(), self.whose)
    }
}

/// How a gateway no setting named is found: the settings looked at first, which named none,
/// then the default sockets, in order ([`crate::config`] states it). The first socket that
/// answers is the gateway; [`connect`] and `sbx wait --for serving` look again on every try.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Search {
    /// The settings that named no endpoint, as said in errors: `--endpoint (not given)`.
    pub unnamed: Vec<String>,
    /// The default sockets, in the order they are tried.
    pub sockets: Vec<DefaultSocket>,
    /// Places that could not even be named (no data dir), as said in errors.
    pub missing: Vec<String>,
}

impl Search {
    /// The first socket there now, else the first of all (what is shown before a dial).
    pub fn pick(&self) -> Option<&DefaultSocket> {
        self.sockets
            .iter()
            .find(|s| s.is_there())
            .or(self.sockets.first())
    }

    /// Every place looked at, in order, with what each held: one line's worth.
    pub fn looked(&self, found: &[String]) -> String {
        let mut places = self.unnamed.clone();
        places.extend(found.iter().cloned());
        places.extend(self.missing.iter().cloned());
        places.join(", ")
    }
}

/// Everything [`connect`] needs: where, with which token, with which TLS settings.
#[derive(Debug, Clone)]
pub struct Target {
    pub address: Address,
    pub token: Option<(Token, Source)>,
    pub tls: TlsSettings,
    /// Set when no setting named the gateway: the default sockets to look for it at
    /// (`address` is then the one first there when the target was made).
    pub search: Option<Search>,
}

impl Target {
    /// A target at `raw` with no credential (tests, and the place a token is not needed).
    pub fn plain(raw: &str) -> Result<Target, CliError> {
        Ok(Target {
            address: Address::parse(raw, false)?,
            token: None,
            tls: TlsSettings::default(),
            search: None,
        })
    }

    /// The same credentials at another address (the one an `--addr-file` names).
    pub fn at(&self, raw: &str) -> Result<Target, CliError> {
        Ok(Target {
            address: Address::parse(raw, !self.tls.is_empty())?,
            token: self.token.clone(),
            tls: self.tls.clone(),
            search: None,
        })
    }

    /// The endpoint as it is dialed: `unix:///…`, `http://…`, `https://…`.
    pub fn endpoint(&self) -> String {
        self.address.to_string()
    }

    fn credentials(&self) -> Result<Credentials, CliError> {
        Credentials::new(self.token.as_ref().map(|(token, source)| (token, source)))
    }
}

/// Connects to the gateway now, with the target's credentials on every call. A target no
/// setting named is looked for at each default socket in turn; when none answers, the error
/// names every place looked at, in order.
pub async fn connect(target: &Target) -> Result<Channel, CliError> {
    let Some(search) = &target.search else {
        return dial(target).await;
    };
    let mut found = Vec::new();
    for socket in &search.sockets {
        if !socket.is_there() {
            found.push(format!("{} (no socket there)", socket.shown()));
            continue;
        }
        let at = Target {
            address: Address::Unix(socket.path.clone()),
            search: None,
            ..target.clone()
        };
        match dial(&at).await {
            Ok(channel) => return Ok(channel),
            Err(CliError::Unreachable { cause, .. }) => {
                found.push(format!("{} ({cause})", socket.shown()))
            }
            Err(other) => return Err(other),
        }
    }
    Err(CliError::NoGateway {
        looked: search.looked(&found),
    })
}

/// Connects to the target's address.
async fn dial(target: &Target) -> Result<Channel, CliError> {
    let credentials = target.credentials()?;
    let endpoint = target.endpoint();
    let channel = match &target.address {
        Address::Unix(path) => {
            let socket = path.clone();
            let connector = tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move {
                    tokio::net::UnixStream::connect(socket)
                        .await
                        .map(TokioIo::new)
                }
            });
            // The URI is only what HTTP/2 puts in :authority; the connector picks the socket.
            Endpoint::from_static("http://localhost")
                .connect_timeout(CONNECT_TIMEOUT)
                .connect_with_connector(connector)
                .await
                .map_err(|err| unix_unreachable(path, &err))?
        }
        Address::Tcp { uri, tls } => {
            let mut dialer = Endpoint::from_shared(uri.clone())
                .map_err(|err| CliError::InvalidEndpoint {
                    endpoint: endpoint.clone(),
                    cause: error_chain(&err),
                })?
                .connect_timeout(CONNECT_TIMEOUT);
            if *tls {
                dialer = dialer
                    .tls_config(tls_config(&target.tls)?)
                    .map_err(|err| CliError::Tls(error_chain(&err)))?;
            }
            dialer.connect().await.map_err(|err| {
                let cause = error_chain(&err);
                let cause = match tcp_mismatch_hint(&cause, *tls) {
                    Some(hint) => format!("{cause} ({hint})"),
                    None => cause,
                };
                CliError::Unreachable { endpoint, cause }
            })?
        }
    };
    Ok(InterceptedService::new(channel, credentials))
}

/// Why a Unix socket could not be dialed, and what to do about it.
fn unix_unreachable(path: &Path, err: &(dyn std::error::Error + 'static)) -> CliError {
    let kind = io_kind(err);
    let shown = path.display();
    let cause = match kind {
        Some(std::io::ErrorKind::NotFound) => format!(
            "no socket at {shown}: sbxd may not be running there (start it with `sbxd serve`, \
             or name the gateway with --endpoint or SBX_ENDPOINT)"
        ),
        Some(std::io::ErrorKind::ConnectionRefused) => format!(
            "nothing listens on {shown} (a socket left by an sbxd that is gone?): sbxd may not \
             be running there (start it with `sbxd serve`, or name the gateway with --endpoint \
             or SBX_ENDPOINT)"
        ),
        Some(std::io::ErrorKind::PermissionDenied) => format!(
            "permission denied on {shown}: sbxd's socket is for the user who runs sbxd (mode \
             0600); run sbx as that user, or dial sbxd's TCP address (`sbxd serve --listen`) \
             with --token"
        ),
        _ => error_chain(err),
    };
    CliError::Unreachable {
        endpoint: format!("unix://{shown}"),
        cause,
    }
}

/// The kind of the first `std::io::Error` in `err`'s source chain.
fn io_kind(err: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        current = e.source();
    }
    None
}

/// tonic's client TLS settings from the CA (else the system's roots), the client identity
/// and the server name, by [`sbx_tls::client_config`], which checks every file now and
/// names the one that is wrong.
fn tls_config(tls: &TlsSettings) -> Result<ClientTlsConfig, CliError> {
    let identity = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
        (None, None) => None,
        (Some(_), None) => {
            return Err(CliError::Tls(
                "--tls-cert needs --tls-key (the client certificate's private key)".to_string(),
            ));
        }
        (None, Some(_)) => {
            return Err(CliError::Tls(
                "--tls-key needs --tls-cert (the client certificate it belongs to)".to_string(),
            ));
        }
    };
    sbx_tls::client_config(tls.ca.as_deref(), identity, tls.server_name.as_deref())
        .map_err(|err| CliError::Tls(err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_to_sockets_and_uris() {
        let unix = |p: &str| Address::Unix(PathBuf::from(p));
        let tcp = |uri: &str, tls| Address::Tcp {
            uri: uri.to_string(),
            tls,
        };
        assert_eq!(
            Address::parse("unix:///run/s.sock", false).unwrap(),
            unix("/run/s.sock")
        );
        assert_eq!(
            Address::parse("unix:/run/s.sock", false).unwrap(),
            unix("/run/s.sock")
        );
        assert_eq!(
            Address::parse(" unix:///a b/s ", true).unwrap(),
            unix("/a b/s")
        );
        assert_eq!(
            Address::parse("127.0.0.1:7070", false).unwrap(),
            tcp("http://127.0.0.1:7070", false)
        );
        assert_eq!(
            Address::parse("127.0.0.1:7070", true).unwrap(),
            tcp("https://127.0.0.1:7070", true)
        );
        assert_eq!(
            Address::parse("http://h:1", true).unwrap(),
            tcp("http://h:1", false)
        );
        assert_eq!(
            Address::parse("https://h:1", false).unwrap(),
            tcp("https://h:1", true)
        );
        for bad in ["unix://relative/s.sock", "unix:s.sock", "ftp://h:1", ""] {
            let err = Address::parse(bad, false).unwrap_err();
            assert!(
                matches!(err, CliError::InvalidEndpoint { .. }),
                "{bad}: {err:?}"
            );
        }
        // What is dialed is shown in one form.
        assert_eq!(unix("/run/s.sock").to_string(), "unix:///run/s.sock");
        assert_eq!(
            Address::parse("unix:/x", false).unwrap().to_string(),
            "unix:///x"
        );
    }

    #[test]
    fn tokens_are_never_shown() {
        let token = Token::new("s3cr3t-value");
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
        let credentials = Credentials::new(Some((&token, &Source::Flag("--token")))).unwrap();
        assert!(
            !format!("{credentials:?}").contains("s3cr3t"),
            "{credentials:?}"
        );
        let target = Target {
            address: Address::Unix("/s".into()),
            token: Some((token, Source::Env("SBX_TOKEN"))),
            tls: TlsSettings::default(),
            search: None,
        };
        assert!(!format!("{target:?}").contains("s3cr3t"), "{target:?}");
        // A token that cannot be a header names where it came from, not what it is.
        let bad = Token::new("s3cr3t with space");
        let err = Credentials::new(Some((&bad, &Source::Context("prod".into())))).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("context \"prod\""), "{text}");
        assert!(!text.contains("s3cr3t"), "{text}");
    }

    #[test]
    fn the_interceptor_puts_the_bearer_token_on_every_call() {
        let token = Token::new(" tok-1\n");
        let mut credentials = Credentials::new(Some((&token, &Source::Flag("--token")))).unwrap();
        for _ in 0..2 {
            let request = credentials.call(tonic::Request::new(())).unwrap();
            assert_eq!(
                request
                    .metadata()
                    .get("authorization")
                    .unwrap()
                    .to_str()
                    .unwrap(),
                "Bearer tok-1"
            );
        }
        let mut none = Credentials::new(None).unwrap();
        let request = none.call(tonic::Request::new(())).unwrap();
        assert!(request.metadata().get("authorization").is_none());
    }

    #[tokio::test]
    async fn a_missing_socket_is_named_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sbxd.sock");
        let target = Target::plain(&format!("unix://{}", path.display())).unwrap();
        let text = connect(&target).await.unwrap_err().to_string();
        assert!(
            text.starts_with(&format!(
                "cannot reach sbxd at unix://{}: no socket at",
                path.display()
            )),
            "{text}"
        );
        assert!(text.contains("sbxd may not be running there"), "{text}");
        assert!(text.contains("--endpoint"), "{text}");
        // A socket file nobody listens on.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let text = connect(&target).await.unwrap_err().to_string();
        assert!(text.contains("nothing listens on"), "{text}");
    }

    /// What a failed call's error says does not hang on what some earlier connection of the
    /// process dialled: the same status reads the same before and after a TLS dial.
    #[tokio::test]
    async fn an_errors_words_do_not_depend_on_an_earlier_dial() {
        let status = || tonic::Status::unavailable("transport error: connection reset");
        let before = CliError::Rpc(status()).to_string();
        // A TLS dial to a port nobody listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let target = Target {
            address: Address::parse(&format!("https://127.0.0.1:{port}"), true).unwrap(),
            token: None,
            tls: TlsSettings::default(),
            search: None,
        };
        assert!(connect(&target).await.is_err());
        assert_eq!(CliError::Rpc(status()).to_string(), before);
    }

    #[test]
    fn tls_files_are_named_when_they_are_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let half = TlsSettings {
            cert: Some(dir.path().join("c.pem")),
            ..TlsSettings::default()
        };
        let err = tls_config(&half).unwrap_err().to_string();
        assert!(err.contains("--tls-key"), "{err}");
        let missing = TlsSettings {
            ca: Some(dir.path().join("nope.pem")),
            ..TlsSettings::default()
        };
        let err = tls_config(&missing).unwrap_err().to_string();
        assert!(err.contains("nope.pem"), "{err}");
        // Without a CA, the system's roots.
        assert!(tls_config(&TlsSettings::default()).is_ok());
    }

    #[tokio::test]
    async fn an_unreachable_gateway_is_named_with_its_cause() {
        // Bind and drop a listener: the port is then (almost certainly) closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let target = Target::plain(&format!("127.0.0.1:{port}")).unwrap();
        let err = connect(&target).await.unwrap_err();
        let text = err.to_string();
        let prefix = format!("cannot reach sbxd at http://127.0.0.1:{port}: ");
        assert!(text.starts_with(&prefix), "{text}");
        assert!(text.len() > prefix.len(), "no cause in {text:?}");
    }

    #[tokio::test]
    async fn a_malformed_endpoint_is_refused() {
        let err = connect(&Target::plain("http://bad host:1").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, CliError::InvalidEndpoint { .. }), "{err:?}");
    }
}
