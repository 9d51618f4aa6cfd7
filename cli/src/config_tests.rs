use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::super::connect::{DefaultSocket, connect};
use super::*;

fn context(endpoint: &str, token: &str) -> Context {
    Context {
        endpoint: Some(endpoint.to_string()),
        token: Some(Token::new(token)),
        ..Context::default()
    }
}

fn default_endpoint_for_tests() -> (Vec<DefaultSocket>, Vec<String>) {
    default_sockets_for(Some(PathBuf::from("/state/sbx")))
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
    // Neither default socket is there: the first of them is shown.
    assert_eq!(t.endpoint(), format!("unix://{SERVICE_SOCKET}"));
    assert!(t.search.is_some());
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

/// Two sockets of the test's own in `dir`, `first` and `second`, in that order.
fn two_sockets(dir: &Path) -> (Vec<DefaultSocket>, Vec<String>) {
    let socket = |name: &str, whose| DefaultSocket {
        path: dir.join(name),
        whose,
    };
    (
        vec![
            socket("first.sock", "the first"),
            socket("second.sock", "the second"),
        ],
        Vec::new(),
    )
}

#[test]
fn the_default_endpoint_is_the_first_default_socket_there_in_the_stated_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let at = |name: &str| format!("unix://{}", d.join(name).display());
    let resolved = |given: &Given, ctx: Option<(&str, &Context)>| {
        resolve(given, ctx, Path::new("/cfg"), || two_sockets(d)).unwrap()
    };
    // Nothing there: the first is shown, and every place is kept for the error.
    let t = resolved(&Given::default(), None);
    assert_eq!(t.endpoint(), at("first.sock"));
    let search = t.search.clone().unwrap();
    assert_eq!(
        search.unnamed,
        [
            "--endpoint (not given)",
            "SBX_ENDPOINT (not set)",
            "the context (none: no --context, no current-context)"
        ]
    );
    assert_eq!(search.sockets, two_sockets(d).0);
    // Only the second there: it. Both there: the first. A file that is no socket: not it.
    let _second = std::os::unix::net::UnixListener::bind(d.join("second.sock")).unwrap();
    assert_eq!(
        resolved(&Given::default(), None).endpoint(),
        at("second.sock")
    );
    std::fs::write(d.join("first.sock"), "not a socket").unwrap();
    assert_eq!(
        resolved(&Given::default(), None).endpoint(),
        at("second.sock")
    );
    std::fs::remove_file(d.join("first.sock")).unwrap();
    let _first = std::os::unix::net::UnixListener::bind(d.join("first.sock")).unwrap();
    assert_eq!(
        resolved(&Given::default(), None).endpoint(),
        at("first.sock")
    );
    // Before the sockets: the flag, the environment, the context, in that order; any of them
    // leaves no search.
    let ctx = context("ctx:1", "");
    let given = |flag: Option<&str>, env: Option<&str>| Given {
        endpoint_flag: flag.map(String::from),
        endpoint_env: env.map(String::from),
        ..Given::default()
    };
    for (g, c, want) in [
        (
            given(Some("flag:1"), Some("env:1")),
            Some(("lab", &ctx)),
            "http://flag:1",
        ),
        (
            given(None, Some("env:1")),
            Some(("lab", &ctx)),
            "http://env:1",
        ),
        (given(None, None), Some(("lab", &ctx)), "http://ctx:1"),
    ] {
        let t = resolved(&g, c);
        assert_eq!(t.endpoint(), want);
        assert!(t.search.is_none(), "{want}");
    }
    // A context without an endpoint, empty settings: said so, in order.
    let t = resolved(
        &given(Some(" "), Some("")),
        Some(("lab", &Context::default())),
    );
    assert_eq!(
        t.search.unwrap().unnamed,
        [
            "--endpoint (set empty)",
            "SBX_ENDPOINT (set empty)",
            "context \"lab\" (it names no endpoint)"
        ]
    );
    // The real places: the package's service socket, then the data dir's.
    let (real, missing) = default_sockets_for(Some(PathBuf::from("/home/u/.local/state/sbx")));
    let paths: Vec<_> = real.iter().map(|s| s.path.clone()).collect();
    assert_eq!(
        paths,
        [
            PathBuf::from("/run/sbx/sbxd.sock"),
            PathBuf::from("/home/u/.local/state/sbx/sbxd.sock")
        ]
    );
    assert!(missing.is_empty());
    let (real, missing) = default_sockets_for(None);
    assert_eq!(real.len(), 1);
    assert!(missing[0].contains("XDG_STATE_HOME or HOME"), "{missing:?}");
}

#[test]
fn with_no_gateway_anywhere_the_error_names_every_place_looked_at_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The second is a socket nothing listens on (left by an sbxd that is gone).
    drop(std::os::unix::net::UnixListener::bind(d.join("second.sock")).unwrap());
    let t = resolve(&Given::default(), None, Path::new("/cfg"), || {
        two_sockets(d)
    })
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = runtime.block_on(connect(&t)).unwrap_err().to_string();
    let places = [
        "--endpoint (not given)".to_string(),
        "SBX_ENDPOINT (not set)".to_string(),
        "the context (none".to_string(),
        format!(
            "unix://{}/first.sock (the first) (no socket there)",
            d.display()
        ),
        format!(
            "unix://{}/second.sock (the second) (nothing listens",
            d.display()
        ),
    ];
    let mut from = 0;
    for place in &places {
        let at = err[from..]
            .find(place.as_str())
            .unwrap_or_else(|| panic!("{place:?} after byte {from} of: {err}"));
        from += at + place.len();
    }
    assert!(
        err.starts_with("no sbxd found; looked, in order, at: "),
        "{err}"
    );
    assert!(err.contains("sbx wait --for serving"), "{err}");
}

#[test]
fn a_wait_for_serving_looks_at_every_default_socket_on_every_try_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let t = resolve(&Given::default(), None, Path::new("/cfg"), || {
        two_sockets(d)
    })
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut progress = Vec::new();
    let started = std::time::Instant::now();
    let err = runtime
        .block_on(crate::wait::wait_serving_with(
            &t,
            None,
            std::time::Duration::from_millis(300),
            &mut progress,
        ))
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(3),
        "bounded by its timeout"
    );
    let progress = String::from_utf8(progress).unwrap();
    assert_eq!(
        progress,
        format!(
            "waiting for sbxd to serve: unix://{0}/first.sock (the first): no socket yet; \
             unix://{0}/second.sock (the second): no socket yet\n",
            d.display()
        ),
        "one line while nothing changes"
    );
    assert!(err.contains("not serving after 0s"), "{err}");
    assert!(
        err.contains("first.sock (the first): no socket yet; "),
        "{err}"
    );
    assert!(
        err.contains("second.sock (the second): no socket yet"),
        "{err}"
    );
}
