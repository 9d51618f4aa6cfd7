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
//! the context (`--context NAME`, else `current-context`), then the default (the endpoint:
//! `unix:///run/sbx/sbxd.sock`, the packaged service's, when it exists, else
//! `unix://<sbxd's default data dir>/sbxd.sock`; no token, no TLS).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::connect::{Address, Source, Target, TlsSettings, Token};
use super::output::{Style, render_table};
use super::{Cli, CliError, ConfigCommand, OutputFormat, SetContextArgs};

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

    fn no_such(&self, name: &str, path: &Path) -> CliError {
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
/// selected one, its relative TLS paths taken from `config_dir`; `default_endpoint` is
/// asked only when nothing else names one.
pub fn resolve(
    given: &Given,
    context: Option<(&str, &Context)>,
    config_dir: &Path,
    default_endpoint: impl FnOnce() -> Result<String, CliError>,
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
    let endpoint = match endpoint {
        Some((endpoint, _)) => endpoint,
        None => default_endpoint()?,
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
    })
}

/// Where the packaged sbxd (its systemd unit, `packaging/sbxd.service`) puts its socket.
pub const SERVICE_SOCKET: &str = "/run/sbx/sbxd.sock";

/// The default endpoint: the packaged service's socket when it is there, else sbxd's socket
/// in its default data dir.
pub fn default_endpoint() -> Result<String, CliError> {
    if std::path::Path::new(SERVICE_SOCKET).exists() {
        return Ok(format!("unix://{SERVICE_SOCKET}"));
    }
    let root = rustix::process::geteuid().is_root();
    let dir =
        sbx_proto::local::default_data_dir(root).ok_or_else(|| CliError::InvalidEndpoint {
            endpoint: "(the default)".to_string(),
            cause: "no data directory: set XDG_STATE_HOME or HOME, or name the gateway with \
                --endpoint or SBX_ENDPOINT"
                .to_string(),
        })?;
    let socket = dir.join(sbx_proto::local::SOCKET_NAME);
    Ok(format!("unix://{}", socket.display()))
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
        resolve(&self.given(), context, &dir, default_endpoint)
    }
}

/// `sbx config …`: edits and shows the config file; never dials.
pub fn run_config(flags: &Flags, cmd: &ConfigCommand) -> Result<u8, CliError> {
    let path = config_path()?;
    let mut config = Config::load(&path)?;
    let mut out = String::new();
    match cmd {
        ConfigCommand::SetContext(args) => {
            let created = set_context(&mut config, flags, args)?;
            if args.use_it {
                config.current_context = Some(args.name.clone());
            }
            config.save(&path)?;
            out.push_str(&format!(
                "context {:?} {} in {}{}\n",
                args.name,
                if created { "created" } else { "updated" },
                path.display(),
                if args.use_it {
                    "; it is the current context"
                } else {
                    ""
                },
            ));
        }
        ConfigCommand::UseContext { name } => {
            if !config.contexts.contains_key(name) {
                return Err(config.no_such(name, &path));
            }
            config.current_context = Some(name.clone());
            config.save(&path)?;
            out.push_str(&format!("current context: {name}\n"));
        }
        ConfigCommand::GetContexts { no_headers } => {
            out = render_contexts(&config, !no_headers);
            if out.is_empty() {
                eprintln!(
                    "no contexts in {} (create one with `sbx config set-context NAME --endpoint \
                     URL …`)",
                    path.display()
                );
            }
        }
        ConfigCommand::CurrentContext => match &config.current_context {
            Some(name) => out.push_str(&format!("{name}\n")),
            None => {
                return Err(CliError::Config {
                    path,
                    cause: "no current context is set (`sbx config use-context NAME`)".to_string(),
                });
            }
        },
        ConfigCommand::DeleteContext { name } => {
            if config.contexts.remove(name).is_none() {
                return Err(config.no_such(name, &path));
            }
            let was_current = config.current_context.as_deref() == Some(name.as_str());
            if was_current {
                config.current_context = None;
            }
            config.save(&path)?;
            out.push_str(&format!(
                "context {name:?} deleted from {}{}\n",
                path.display(),
                if was_current {
                    "; no context is current now"
                } else {
                    ""
                }
            ));
        }
    }
    super::reply::print(&out)?;
    Ok(0)
}

/// Creates or updates the context `args.name` with the settings given (the global
/// `--endpoint`, `--token`, `--tls-*` flags, and `--token-file`); an empty value removes a
/// setting; paths are saved absolute. Answers whether it was created.
pub fn set_context(
    config: &mut Config,
    flags: &Flags,
    args: &SetContextArgs,
) -> Result<bool, CliError> {
    check_context_name(&args.name)?;
    let created = !config.contexts.contains_key(&args.name);
    let context = config.contexts.entry(args.name.clone()).or_default();
    fn put<T>(slot: &mut Option<T>, given: Option<T>, empty: impl Fn(&T) -> bool) {
        if let Some(value) = given {
            *slot = if empty(&value) { None } else { Some(value) };
        }
    }
    let absolute = |p: &Option<PathBuf>| -> Result<Option<PathBuf>, CliError> {
        match p {
            Some(p) if p.as_os_str().is_empty() => Ok(Some(PathBuf::new())),
            Some(p) => std::path::absolute(p)
                .map(Some)
                .map_err(|source| CliError::LocalPath {
                    path: p.clone(),
                    source,
                }),
            None => Ok(None),
        }
    };
    let token = flags.token.clone();
    if let Some(token) = &token
        && !token.is_empty()
    {
        // Refuse now what would fail on every call later.
        let source = Source::Flag(flags.token_source());
        super::connect::Credentials::new(Some((token, &source)))?;
    }
    if let Some(endpoint) = &flags.endpoint
        && !endpoint.trim().is_empty()
    {
        Address::parse(endpoint, false)?;
    }
    put(&mut context.endpoint, flags.endpoint.clone(), |s| {
        s.trim().is_empty()
    });
    put(&mut context.token, token, Token::is_empty);
    let empty_path = |p: &PathBuf| p.as_os_str().is_empty();
    put(&mut context.tls_ca, absolute(&flags.tls.ca)?, empty_path);
    put(
        &mut context.tls_cert,
        absolute(&flags.tls.cert)?,
        empty_path,
    );
    put(&mut context.tls_key, absolute(&flags.tls.key)?, empty_path);
    put(
        &mut context.tls_server_name,
        flags.tls.server_name.clone(),
        |s| s.trim().is_empty(),
    );
    Ok(created)
}

/// A context name: one word of letters, digits, `-`, `_`, `.`, `@`, at most 253 characters.
fn check_context_name(name: &str) -> Result<(), CliError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'));
    if ok {
        Ok(())
    } else {
        Err(CliError::Usage(format!(
            "context name {name:?}: use letters, digits, '-', '_', '.', '@' (1 to 253 characters)"
        )))
    }
}

/// `sbx config get-contexts`: CURRENT, NAME, ENDPOINT, TOKEN (`set` or `-`, never the value)
/// and TLS (which TLS settings are there).
pub fn render_contexts(config: &Config, headers: bool) -> String {
    let dash = || "-".to_string();
    let rows: Vec<Vec<String>> = config
        .contexts
        .iter()
        .map(|(name, c)| {
            let current = config.current_context.as_deref() == Some(name.as_str());
            let tls: Vec<&str> = [
                (c.tls_ca.is_some(), "ca"),
                (c.tls_cert.is_some(), "cert"),
                (c.tls_key.is_some(), "key"),
                (c.tls_server_name.is_some(), "server-name"),
            ]
            .into_iter()
            .filter_map(|(set, what)| set.then_some(what))
            .collect();
            vec![
                if current {
                    "*".to_string()
                } else {
                    String::new()
                },
                name.clone(),
                c.endpoint.clone().unwrap_or_else(dash),
                if c.token.is_some() {
                    "set".to_string()
                } else {
                    dash()
                },
                if tls.is_empty() {
                    dash()
                } else {
                    tls.join(",")
                },
            ]
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    render_table(
        &["CURRENT", "NAME", "ENDPOINT", "TOKEN", "TLS"],
        &rows,
        Style {
            format: OutputFormat::Table,
            headers,
        },
    )
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
