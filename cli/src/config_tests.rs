use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::*;

fn context(endpoint: &str, token: &str) -> Context {
    Context {
        endpoint: Some(endpoint.to_string()),
        token: Some(Token::new(token)),
        ..Context::default()
    }
}

fn default_endpoint_for_tests() -> Result<String, CliError> {
    Ok("unix:///state/sbx/sbxd.sock".to_string())
}

#[test]
fn the_config_file_is_found_by_the_environment() {
    let p = |s: &str| Some(PathBuf::from(s));
    let path = |a, b, c| resolve_config_path(a, b, c).unwrap();
    assert_eq!(
        path(p("/x/c.toml"), p("/xdg"), p("/home/u")),
        PathBuf::from("/x/c.toml")
    );
    assert_eq!(
        path(p(""), p("/xdg"), p("/home/u")),
        PathBuf::from("/xdg/sbx/config.toml")
    );
    assert_eq!(
        path(None, p(""), p("/home/u")),
        PathBuf::from("/home/u/.config/sbx/config.toml")
    );
    let err = resolve_config_path(None, None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("SBX_CONFIG"), "{err}");
}

#[test]
fn the_config_round_trips_mode_0600_and_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub").join("config.toml");
    let mut config = Config {
        current_context: Some("lab".into()),
        ..Config::default()
    };
    config.contexts.insert("lab".into(), {
        let mut c = context("https://lab:7070", "tok-lab");
        c.tls_ca = Some("/etc/ca.pem".into());
        c.tls_server_name = Some("sbxd.lab".into());
        c
    });
    config.contexts.insert("local".into(), Context::default());
    config.save(&path).unwrap();
    assert_eq!(Config::load(&path).unwrap(), config);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let dir_mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("current-context = \"lab\""), "{text}");
    assert!(
        text.contains("[contexts.lab]") && text.contains("tls-server-name"),
        "{text}"
    );

    // A second save replaces the file by a rename (a new inode), not by rewriting it in
    // place, and leaves no temp file behind.
    let before = meta.ino();
    config.contexts.remove("local");
    config.save(&path).unwrap();
    assert_ne!(std::fs::metadata(&path).unwrap().ino(), before);
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["config.toml"]);
    assert_eq!(Config::load(&path).unwrap(), config);
    // A file that does not exist is an empty config.
    assert_eq!(
        Config::load(&dir.path().join("none.toml")).unwrap(),
        Config::default()
    );
}

#[test]
fn a_broken_config_file_names_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(
        &path,
        "current-context = \"a\"\n[contexts.a]\nendpoint = \n",
    )
    .unwrap();
    let err = Config::load(&path).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("line 3"), "{err}");
    assert!(!err.contains('\n'), "{err:?}");
    // A misspelt key is refused, not ignored.
    std::fs::write(&path, "[contexts.a]\ntls_ca = \"/ca.pem\"\n").unwrap();
    let err = Config::load(&path).unwrap_err().to_string();
    assert!(err.contains("tls_ca") && err.contains("line 2"), "{err}");
}

#[test]
fn settings_come_from_flag_then_env_then_context_then_default() {
    let lab = context("https://lab:7070", "tok-ctx");
    let dir = Path::new("/cfg");
    let token_of = |t: &Target| {
        t.token
            .as_ref()
            .map(|(t, s)| (t.expose().to_string(), s.clone()))
    };
    let everything = Given {
        endpoint_flag: Some("unix:///flag.sock".into()),
        endpoint_env: Some("env:1".into()),
        token_flag: Some(Token::new("tok-flag")),
        token_flag_name: "",
        token_env: Some(Token::new("tok-env")),
        tls: TlsSettings::default(),
    };
    let t = resolve(
        &everything,
        Some(("lab", &lab)),
        dir,
        default_endpoint_for_tests,
    )
    .unwrap();
    assert_eq!(t.endpoint(), "unix:///flag.sock");
    assert_eq!(
        token_of(&t),
        Some(("tok-flag".into(), Source::Flag("--token")))
    );

    let env_only = Given {
        endpoint_flag: None,
        token_flag: None,
        ..everything.clone()
    };
    let t = resolve(
        &env_only,
        Some(("lab", &lab)),
        dir,
        default_endpoint_for_tests,
    )
    .unwrap();
    assert_eq!(t.endpoint(), "http://env:1");
    assert_eq!(
        token_of(&t),
        Some(("tok-env".into(), Source::Env("SBX_TOKEN")))
    );

    // Empty values count as unset.
    let empty = Given {
        endpoint_env: Some(" ".into()),
        token_env: Some(Token::new("")),
        ..Given::default()
    };
    let t = resolve(&empty, Some(("lab", &lab)), dir, default_endpoint_for_tests).unwrap();
    assert_eq!(t.endpoint(), "https://lab:7070");
    assert_eq!(
        token_of(&t),
        Some(("tok-ctx".into(), Source::Context("lab".into())))
    );

    let t = resolve(&Given::default(), None, dir, default_endpoint_for_tests).unwrap();
    assert_eq!(t.endpoint(), "unix:///state/sbx/sbxd.sock");
    assert!(t.token.is_none());
    // The default is not even asked for when something names the endpoint.
    let t = resolve(&everything, None, dir, || panic!("default asked")).unwrap();
    assert_eq!(t.endpoint(), "unix:///flag.sock");
}

#[test]
fn tls_settings_mix_flags_and_the_context_and_make_bare_addresses_https() {
    let ctx = Context {
        endpoint: Some("lab:7070".into()),
        tls_ca: Some("ca.pem".into()),
        tls_cert: Some("/abs/cert.pem".into()),
        tls_key: Some("/abs/key.pem".into()),
        tls_server_name: Some("sbxd.lab".into()),
        ..Context::default()
    };
    let given = Given {
        tls: TlsSettings {
            cert: Some("/flag/cert.pem".into()),
            ..TlsSettings::default()
        },
        ..Given::default()
    };
    let t = resolve(
        &given,
        Some(("lab", &ctx)),
        Path::new("/cfg"),
        default_endpoint_for_tests,
    )
    .unwrap();
    assert_eq!(t.endpoint(), "https://lab:7070");
    assert_eq!(
        t.tls,
        TlsSettings {
            // A relative path in the file is relative to the file's directory.
            ca: Some("/cfg/ca.pem".into()),
            cert: Some("/flag/cert.pem".into()),
            key: Some("/abs/key.pem".into()),
            server_name: Some("sbxd.lab".into()),
        }
    );
}

#[test]
fn a_context_that_does_not_exist_lists_those_that_do() {
    let mut config = Config::default();
    config.contexts.insert("dev".into(), Context::default());
    config.contexts.insert("lab".into(), Context::default());
    let path = Path::new("/c/config.toml");
    let err = config.select(Some("prod"), path).unwrap_err().to_string();
    assert_eq!(
        err,
        "no context \"prod\" in /c/config.toml: the contexts there are dev, lab"
    );
    assert!(config.select(None, path).unwrap().is_none());
    config.current_context = Some("gone".into());
    let err = config.select(None, path).unwrap_err().to_string();
    assert!(
        err.contains("\"gone\"") && err.contains("dev, lab"),
        "{err}"
    );
    assert_eq!(config.select(Some("lab"), path).unwrap().unwrap().0, "lab");
    let err = Config::default()
        .select(Some("x"), path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("it has none"), "{err}");
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
        token: Some(super::read_token_file(&token_file).unwrap()),
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
