//! Contexts: named gateways with their credentials, kept in a config file, as kubeconfig keeps
//! clusters (`sbx config …`), and the resolution of where a call goes and with what.
//!
//! The file is `$SBX_CONFIG`, else `$XDG_CONFIG_HOME/sbx/config.toml`, else
//! `~/.config/sbx/config.toml`:
//!
//! ```toml
//! current-context = "lab"
//! [contexts.lab]
//! endpoint = "https://lab.example:7070"
//! token = "…"
//! tls-ca = "/home/me/.config/sbx/lab-ca.pem"
//! ```
//!
//! It holds tokens, so it is written mode 0600 (its directory 0700 when sbx creates it), and
//! atomically (a temp file in the same directory, synced, renamed over the old one), so a
//! crash or a full disk leaves the old file or the new one, never half of one. Unknown keys
//! are refused (with the file, line and column, as toml reports them) rather than ignored, so
//! a misspelt `tls_ca` does not silently dial without the CA.
//!
//! Precedence, per setting: a flag, then the environment (`SBX_ENDPOINT`, `SBX_TOKEN`), then
//! the context (`--context NAME`, else `current-context`), then the default (no token, no
//! TLS). The default endpoint is looked for, in this order, at the packaged service's socket,
//! `/run/sbx/sbxd.sock` (`packaging/sbxd.service` serves there), then at the socket of sbxd in
//! this user's default data dir, `DATA/sbxd.sock` (`sbxd serve` with no flags: DATA is
//! /var/lib/sbx for root, else $XDG_STATE_HOME/sbx, else ~/.local/state/sbx): the first that
//! answers is the gateway, looked for again on every dial, so `sbx wait --for serving` waits
//! for a socket that is not there yet. When none answers, the error names every place looked
//! at, in order (the flag, the environment and the context included). It used to be the
//! service's socket when it existed, else the data dir's: right after `systemctl start sbxd`,
//! before the service made its socket, `sbx wait --for serving` waited its whole timeout at
//! the data dir's socket, where nothing would ever serve.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::connect::{Address, DefaultSocket, Search, Source, Target, TlsSettings, Token};
use super::{Cli, CliError};

/// The config file: the current context and the contexts by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Config {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub contexts: BTreeMap<String, Context>,
}

/// One context: a gateway and how to talk to it. Every setting may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Context {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Token>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
}

/// Where the config file is: `$SBX_CONFIG`, else `$XDG_CONFIG_HOME/sbx/config.toml`, else
/// `~/.config/sbx/config.toml`.
pub fn config_path() -> Result<PathBuf, CliError> {
    resolve_config_path(
        std::env::var_os("SBX_CONFIG").map(PathBuf::from),
        std::env::var_os("XDG_CONFIG_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

/// [`config_path`] without the environment. Empty variables count as unset.
pub fn resolve_config_path(
    sbx_config: Option<PathBuf>,
    xdg_config_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> Result<PathBuf, CliError> {
    let set = |p: Option<PathBuf>| p.filter(|p| !p.as_os_str().is_empty());
    if let Some(path) = set(sbx_config) {
        return Ok(path);
    }
    if let Some(dir) = set(xdg_config_home) {
        return Ok(dir.join("sbx").join("config.toml"));
    }
    match set(home) {
        Some(home) => Ok(home.join(".config").join("sbx").join("config.toml")),
        None => Err(CliError::Config {
            path: PathBuf::from("~/.config/sbx/config.toml"),
            cause: "neither SBX_CONFIG, XDG_CONFIG_HOME nor HOME is set, so there is no place \
                    for it; set SBX_CONFIG"
                .to_string(),
        }),
    }
}

impl Config {
    /// Reads the file; a file that does not exist is an empty config.
    pub fn load(path: &Path) -> Result<Config, CliError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(err) => {
                return Err(CliError::Config {
                    path: path.to_path_buf(),
                    cause: format!("cannot read it: {err}"),
                });
            }
        };
        toml::from_str(&text).map_err(|err| CliError::Config {
            path: path.to_path_buf(),
            // toml's message begins "TOML parse error at line L, column C" and shows the line.
            cause: err.to_string().trim_end().replace('\n', " "),
        })
    }

    /// Writes the file atomically, mode 0600, creating its directory (0700) when missing.
    pub fn save(&self, path: &Path) -> Result<(), CliError> {
        let failed = |what: &str, err: &dyn std::fmt::Display| CliError::Config {
            path: path.to_path_buf(),
            cause: format!("cannot {what}: {err}"),
        };
        let text = toml::to_string(self).map_err(|e| failed("render it", &e))?;
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        };
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| failed(&format!("create its directory {}", dir.display()), &e))?;
        }
        // tempfile creates the file mode 0600, so the tokens are never readable by others,
        // not even for a moment; set it anyway, so the mode does not hang on that detail.
        let mut file =
            tempfile::NamedTempFile::new_in(&dir).map_err(|e| failed("create a temp file", &e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            file.as_file()
                .set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|e| failed("make it mode 0600", &e))?;
        }
        file.write_all(text.as_bytes())
            .and_then(|()| file.as_file().sync_all())
            .map_err(|e| failed("write it", &e))?;
        file.persist(path)
            .map_err(|e| failed("replace it", &e.error))?;
        // The rename itself is durable once the directory is synced.
        if let Ok(dir) = std::fs::File::open(&dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    }

    /// The error for a context `name` the file at `path` lacks, listing the ones it has.
    pub fn no_such(&self, name: &str, path: &Path) -> CliError {
        CliError::NoSuchContext {
            name: name.to_string(),
            path: path.to_path_buf(),
            known: self.contexts.keys().cloned().collect(),
        }
    }

    /// The context a call uses: `chosen` (`--context`), else the current one, else none. A
    /// name that is not in the file is an error listing the ones that are.
    pub fn select<'a>(
        &'a self,
        chosen: Option<&'a str>,
        path: &Path,
    ) -> Result<Option<(&'a str, &'a Context)>, CliError> {
        let Some(name) = chosen.or(self.current_context.as_deref()) else {
            return Ok(None);
        };
        match self.contexts.get(name) {
            Some(context) => Ok(Some((name, context))),
            None => Err(self.no_such(name, path)),
        }
    }
}

/// The settings given on the command line and in the environment, for [`resolve`].
#[derive(Debug, Clone, Default)]
pub struct Given {
    pub endpoint_flag: Option<String>,
    pub endpoint_env: Option<String>,
    pub token_flag: Option<Token>,
    /// Which flag gave `token_flag` (`--token`, `--token-file`); empty means `--token`.
    pub token_flag_name: &'static str,
    pub token_env: Option<Token>,
    pub tls: TlsSettings,
}

/// Where a call goes and with what, by the precedence in the module doc. `context` is the
/// selected one, its relative TLS paths taken from `config_dir`; `default_sockets` (the
/// places the gateway is looked for, in order, and those that could not be named) is asked
/// only when nothing else names one.
pub fn resolve(
    given: &Given,
    context: Option<(&str, &Context)>,
    config_dir: &Path,
    default_sockets: impl FnOnce() -> (Vec<DefaultSocket>, Vec<String>),
) -> Result<Target, CliError> {
    fn first<T>(candidates: impl IntoIterator<Item = (Option<T>, Source)>) -> Option<(T, Source)> {
        candidates
            .into_iter()
            .find_map(|(value, source)| value.map(|v| (v, source)))
    }
    let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.trim().is_empty());
    let token = |t: &Option<Token>| t.clone().filter(|t| !t.is_empty());
    let from_context = |name: &str| Source::Context(name.to_string());
    let (ctx_name, ctx) = match context {
        Some((name, ctx)) => (Some(name), Some(ctx)),
        None => (None, None),
    };
    let ctx_source = || ctx_name.map(from_context).unwrap_or(Source::Default);
    let in_dir = |p: &Option<PathBuf>| p.as_ref().map(|p| config_dir.join(p));

    let tls = TlsSettings {
        ca: given
            .tls
            .ca
            .clone()
            .or_else(|| ctx.and_then(|c| in_dir(&c.tls_ca))),
        cert: given
            .tls
            .cert
            .clone()
            .or_else(|| ctx.and_then(|c| in_dir(&c.tls_cert))),
        key: given
            .tls
            .key
            .clone()
            .or_else(|| ctx.and_then(|c| in_dir(&c.tls_key))),
        server_name: nonempty(&given.tls.server_name)
            .or_else(|| ctx.and_then(|c| nonempty(&c.tls_server_name))),
    };
    let endpoint = first([
        (nonempty(&given.endpoint_flag), Source::Flag("--endpoint")),
        (nonempty(&given.endpoint_env), Source::Env("SBX_ENDPOINT")),
        (ctx.and_then(|c| nonempty(&c.endpoint)), ctx_source()),
    ]);
    let (endpoint, search) = match endpoint {
        Some((endpoint, _)) => (endpoint, None),
        None => {
            let (sockets, missing) = default_sockets();
            let unset = |value: &Option<String>, unset: &str| match value {
                Some(_) => "set empty".to_string(),
                None => unset.to_string(),
            };
            let search = Search {
                unnamed: vec![
                    format!("--endpoint ({})", unset(&given.endpoint_flag, "not given")),
                    format!("SBX_ENDPOINT ({})", unset(&given.endpoint_env, "not set")),
                    match ctx_name {
                        Some(name) => format!("context {name:?} (it names no endpoint)"),
                        None => "the context (none: no --context, no current-context)".into(),
                    },
                ],
                sockets,
                missing,
            };
            let endpoint = match search.pick() {
                Some(socket) => format!("unix://{}", socket.path.display()),
                None => {
                    return Err(CliError::NoGateway {
                        looked: search.looked(&[]),
                    });
                }
            };
            (endpoint, Some(search))
        }
    };
    let token = first([
        (
            token(&given.token_flag),
            Source::Flag(if given.token_flag_name.is_empty() {
                "--token"
            } else {
                given.token_flag_name
            }),
        ),
        (token(&given.token_env), Source::Env("SBX_TOKEN")),
        (ctx.and_then(|c| token(&c.token)), ctx_source()),
    ]);
    Ok(Target {
        address: Address::parse(&endpoint, !tls.is_empty())?,
        token,
        tls,
        search,
    })
}

/// Where the packaged sbxd (its systemd unit, `packaging/sbxd.service`) puts its socket.
pub const SERVICE_SOCKET: &str = "/run/sbx/sbxd.sock";

/// The places the default endpoint is looked for, in order: the packaged service's socket,
/// then sbxd's socket in this user's default data dir (left out, and said, when there is no
/// data dir: no HOME, no XDG_STATE_HOME).
pub fn default_sockets() -> (Vec<DefaultSocket>, Vec<String>) {
    let root = rustix::process::geteuid().is_root();
    default_sockets_for(sbx_proto::local::default_data_dir(root))
}

/// [`default_sockets`] for the data dir `data_dir`.
pub fn default_sockets_for(data_dir: Option<PathBuf>) -> (Vec<DefaultSocket>, Vec<String>) {
    let mut sockets = vec![DefaultSocket {
        path: PathBuf::from(SERVICE_SOCKET),
        whose: "the sbx package's service",
    }];
    let mut missing = Vec::new();
    match data_dir {
        Some(dir) => sockets.push(DefaultSocket {
            path: dir.join(sbx_proto::local::SOCKET_NAME),
            whose: "sbxd serve's default, in your data dir",
        }),
        None => {
            missing.push("your data dir's socket (none: set XDG_STATE_HOME or HOME)".to_string())
        }
    }
    (sockets, missing)
}

/// The global flags of one command line: where, with what, which context.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub endpoint: Option<String>,
    pub token: Option<Token>,
    /// Which flag gave `token`: `--token` or `--token-file` (for errors that name it).
    pub token_flag: &'static str,
    pub context: Option<String>,
    pub tls: TlsSettings,
}

/// What sbx says when a token is given on the command line.
pub const TOKEN_ON_COMMAND_LINE: &str = "warning: a token given with --token is on the command \
    line, which every user of this machine can read (ps); give it as SBX_TOKEN or with \
    --token-file FILE instead";

/// The token in `file`: its first line, trimmed.
pub fn read_token_file(file: &std::path::Path) -> Result<Token, CliError> {
    let text = std::fs::read_to_string(file).map_err(|source| CliError::LocalPath {
        path: file.to_path_buf(),
        source,
    })?;
    Ok(Token::new(text.lines().next().unwrap_or("").trim()))
}

impl Cli {
    /// This command line's global flags (a `--token-file` read now); warns on stderr of a
    /// token given on the command line.
    pub fn flags(&self) -> Result<Flags, CliError> {
        if self.token.is_some() {
            eprintln!("{TOKEN_ON_COMMAND_LINE}");
        }
        let token = match &self.token_file {
            Some(file) => Some(read_token_file(file)?),
            None => self.token.clone(),
        };
        Ok(Flags {
            endpoint: self.endpoint.clone(),
            token,
            token_flag: if self.token_file.is_some() {
                "--token-file"
            } else {
                "--token"
            },
            context: self.context.clone(),
            tls: TlsSettings {
                ca: self.tls_ca.clone(),
                cert: self.tls_cert.clone(),
                key: self.tls_key.clone(),
                server_name: self.tls_server_name.clone(),
            },
        })
    }
}

impl Flags {
    /// The flag that gave the token.
    pub fn token_source(&self) -> &'static str {
        if self.token_flag.is_empty() {
            "--token"
        } else {
            self.token_flag
        }
    }

    /// The flags and the environment.
    pub fn given(&self) -> Given {
        let env = |name: &str| std::env::var(name).ok();
        Given {
            endpoint_flag: self.endpoint.clone(),
            endpoint_env: env("SBX_ENDPOINT"),
            token_flag: self.token.clone(),
            token_flag_name: self.token_source(),
            token_env: env("SBX_TOKEN").map(Token::new),
            tls: self.tls.clone(),
        }
    }

    /// Where this command dials and with what: flags, environment, context, default. A
    /// config file that does not exist is no context.
    pub fn target(&self) -> Result<Target, CliError> {
        let (config, path) = match config_path() {
            Ok(path) => (Config::load(&path)?, path),
            // No place for a config file: fine unless a context is asked for.
            Err(err) if self.context.is_some() => return Err(err),
            Err(_) => (Config::default(), PathBuf::new()),
        };
        let context = config.select(self.context.as_deref(), &path)?;
        let dir = path.parent().unwrap_or(Path::new("")).to_path_buf();
        resolve(&self.given(), context, &dir, default_sockets)
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
