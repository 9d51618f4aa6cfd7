//! `sbx config …`: the contexts of the config file (`crate::config`) shown and edited; never
//! dials.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::CliError;
use crate::config::{Config, Flags, config_path};
use crate::connect::{Address, Source, Token};
use crate::output::{OutputFormat, Style, render_table};

/// The long help of `sbx config`.
pub const CONFIG_ABOUT: &str = "Keep gateways and their credentials as named contexts.\n\n\
    The config file is $SBX_CONFIG, else $XDG_CONFIG_HOME/sbx/config.toml, else \
    ~/.config/sbx/config.toml. It holds tokens, so sbx writes it mode 0600, atomically (a \
    temp file renamed over it). A context has an endpoint, a token and TLS settings (tls-ca, \
    tls-cert, tls-key, tls-server-name), each optional; a call uses the context named by \
    --context, else the current-context, for what its flags and SBX_ENDPOINT/SBX_TOKEN leave \
    unsaid.\n\n\
    Example:\n  sbx config set-context lab --endpoint https://lab:7070 --token-file tok \
    --tls-ca ca.pem --use\n  sbx config get-contexts\n  sbx --context local sandbox ls";

/// `sbx config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Create or update a context with the settings given (--endpoint, --token or
    /// --token-file, --tls-ca, --tls-cert, --tls-key, --tls-server-name); settings not given
    /// are kept, an empty value ("") removes one. SBX_ENDPOINT and SBX_TOKEN are not saved.
    #[command(name = "set-context")]
    SetContext(SetContextArgs),
    /// Make NAME the current context.
    #[command(name = "use-context")]
    UseContext {
        /// The context.
        name: String,
    },
    /// List the contexts: which is current, their endpoints, whether a token is saved (never
    /// the token) and which TLS settings are.
    #[command(name = "get-contexts")]
    GetContexts {
        /// Leave out the header line.
        #[arg(long)]
        no_headers: bool,
    },
    /// Print the name of the current context.
    #[command(name = "current-context")]
    CurrentContext,
    /// Delete a context (and unset current-context when it was the current one).
    #[command(name = "delete-context")]
    DeleteContext {
        /// The context.
        name: String,
    },
}

/// `sbx config set-context`.
#[derive(Debug, Clone, Args)]
pub struct SetContextArgs {
    /// The context's name (letters, digits, '-', '_', '.', '@'). Its token comes from the
    /// global --token-file FILE (or --token).
    pub name: String,
    /// Also make it the current context.
    #[arg(long = "use")]
    pub use_it: bool,
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
    crate::reply::print(&out)?;
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
        crate::connect::Credentials::new(Some((token, &source)))?;
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
mod tests {
    use super::*;
    use crate::config::{Context, read_token_file};
    use crate::connect::TlsSettings;

    fn context(endpoint: &str, token: &str) -> Context {
        Context {
            endpoint: Some(endpoint.to_string()),
            token: Some(Token::new(token)),
            ..Context::default()
        }
    }

    #[test]
    fn set_context_merges_removes_and_checks() {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("tok");
        std::fs::write(&token_file, "tok-file\n").unwrap();
        let args = |_: Option<PathBuf>| SetContextArgs {
            name: "lab".into(),
            use_it: false,
        };
        let mut config = Config::default();
        let flags = Flags {
            endpoint: Some("https://lab:7070".into()),
            token: Some(Token::new("tok-1")),
            tls: TlsSettings {
                ca: Some("rel/ca.pem".into()),
                ..TlsSettings::default()
            },
            ..Flags::default()
        };
        assert!(set_context(&mut config, &flags, &args(None)).unwrap());
        let lab = &config.contexts["lab"];
        assert_eq!(lab.endpoint.as_deref(), Some("https://lab:7070"));
        assert_eq!(lab.token.as_ref().unwrap().expose(), "tok-1");
        let ca = lab.tls_ca.clone().unwrap();
        assert!(ca.is_absolute() && ca.ends_with("rel/ca.pem"), "{ca:?}");

        // An update keeps what it does not name; a token file's line is the token; an empty
        // value removes a setting.
        let flags = Flags {
            endpoint: Some(String::new()),
            token: Some(read_token_file(&token_file).unwrap()),
            token_flag: "--token-file",
            ..Flags::default()
        };
        assert!(!set_context(&mut config, &flags, &args(None)).unwrap());
        let lab = &config.contexts["lab"];
        assert_eq!(lab.endpoint, None);
        assert_eq!(lab.token.as_ref().unwrap().expose(), "tok-file");
        assert_eq!(lab.tls_ca, Some(ca));

        let bad_token = Flags {
            token: Some(Token::new("two words")),
            ..Flags::default()
        };
        let err = set_context(&mut config, &bad_token, &args(None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--token") && !err.contains("two words"),
            "{err}"
        );
        let bad_name = SetContextArgs {
            name: "a b".into(),
            ..args(None)
        };
        assert!(set_context(&mut config, &Flags::default(), &bad_name).is_err());
        let bad_endpoint = Flags {
            endpoint: Some("ftp://x:1".into()),
            ..Flags::default()
        };
        assert!(set_context(&mut config, &bad_endpoint, &args(None)).is_err());
    }

    #[test]
    fn get_contexts_shows_whether_a_token_is_set_never_its_value() {
        let mut config = Config {
            current_context: Some("lab".into()),
            ..Config::default()
        };
        let mut lab = context("https://lab:7070", "s3cr3t");
        lab.tls_ca = Some("/ca.pem".into());
        config.contexts.insert("lab".into(), lab);
        config.contexts.insert(
            "local".into(),
            Context {
                endpoint: Some("unix:///run/sbxd.sock".into()),
                ..Context::default()
            },
        );
        let text = render_contexts(&config, true);
        assert!(!text.contains("s3cr3t"), "{text}");
        assert!(!format!("{config:?}").contains("s3cr3t"));
        let lines: Vec<Vec<&str>> = text
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(lines[0], ["CURRENT", "NAME", "ENDPOINT", "TOKEN", "TLS"]);
        assert_eq!(lines[1], ["*", "lab", "https://lab:7070", "set", "ca"]);
        assert_eq!(lines[2], ["local", "unix:///run/sbxd.sock", "-", "-"]);
        assert_eq!(render_contexts(&config, false).lines().count(), 2);
        assert_eq!(render_contexts(&Config::default(), true), "");
    }
}
