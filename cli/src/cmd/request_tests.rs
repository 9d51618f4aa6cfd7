//! Command line → request, as data: each case parses an argv with the real clap types and
//! compares the request built from it.

use std::collections::{HashMap, HashSet};

use clap::Parser;
use rand::SeedableRng;
use sbx_proto::v1::{
    CreateSandboxRequest, ExecRequest, LogsRequest, PullImageRequest, Resources, SandboxRef,
    SandboxSpec, Tty, WatchSandboxesRequest, WorkspaceRef,
};

use crate::cmd::image::pull::pull_image_request;
use crate::cmd::image::{ImageCommand, describe_image_ref, image_ref};
use crate::cmd::sandbox::create::{create_sandbox_request, generate_sandbox_name};
use crate::cmd::sandbox::exec::exec_request;
use crate::cmd::sandbox::logs::{logs_request, logs_request_at, parse_since};
use crate::cmd::sandbox::watch::watch_request;
use crate::cmd::sandbox::{
    SandboxCommand, describe_sandbox_ref, list_sandboxes_request, sandbox_ref,
};
use crate::cmd::workspace::{
    WorkspaceCommand, create_workspace_request, delete_workspace_request, describe_workspace_ref,
    list_workspaces_request, workspace_ref,
};
use crate::output::OutputFormat;
use crate::{Cli, Command};

const ID: &str = "0192a6f4-3c1e-7d2a-9f00-1234567890ab";

fn parse(argv: &[&str]) -> Cli {
    match Cli::try_parse_from(std::iter::once("sbx").chain(argv.iter().copied())) {
        Ok(cli) => cli,
        Err(err) => panic!("argv {argv:?} did not parse: {err}"),
    }
}

/// A usage error: clap's exit status 2, and a message containing `needle`.
fn check_usage_error(argv: &[&str], needle: &str) {
    let err = Cli::try_parse_from(std::iter::once("sbx").chain(argv.iter().copied()))
        .expect_err(&format!("argv {argv:?} should be refused"));
    assert_eq!(err.exit_code(), 2, "argv {argv:?}: {err}");
    let text = err.to_string();
    assert!(
        text.contains(needle),
        "argv {argv:?}: {text:?} lacks {needle:?}"
    );
}

fn sandbox(argv: &[&str]) -> SandboxCommand {
    let mut full = vec!["sandbox"];
    full.extend_from_slice(argv);
    match parse(&full).command {
        Command::Sandbox(cmd) => cmd,
        other => panic!("argv {argv:?} parsed as {other:?}"),
    }
}

fn workspace(argv: &[&str]) -> WorkspaceCommand {
    let mut full = vec!["workspace"];
    full.extend_from_slice(argv);
    match parse(&full).command {
        Command::Workspace(cmd) => cmd,
        other => panic!("argv {argv:?} parsed as {other:?}"),
    }
}

fn check_create(argv: &[&str], expected: CreateSandboxRequest) {
    let SandboxCommand::Create(args) = sandbox(argv) else {
        panic!("argv {argv:?} is not sandbox create");
    };
    let got = create_sandbox_request(&args, "sbx-generated".to_string()).unwrap();
    assert_eq!(got, expected, "argv {argv:?}");
}

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn sandbox_create_builds_the_request() {
    check_create(
        &[
            "create", "-w", "team-a", "--name", "web", "--label", "app=web", "-l", "tier=1",
            "--env", "A=1", "-e", "B=x=y", "--cpu", "500m", "--memory", "64Mi", "--image",
            "alpine", "--driver", "oci", "--", "sh", "-c", "echo hi",
        ],
        CreateSandboxRequest {
            providers: Default::default(),
            workspace: "team-a".into(),
            name: "web".into(),
            spec: Some(SandboxSpec {
                command: strings(&["sh", "-c", "echo hi"]),
                env: map(&[("A", "1"), ("B", "x=y")]),
                labels: map(&[("app", "web"), ("tier", "1")]),
                resources: Some(Resources {
                    cpu_millis: 500,
                    memory_bytes: 64 << 20,
                    disk_bytes: 0,
                }),
                driver: "oci".into(),
                image: "alpine".into(),
                image_digest: String::new(),
                network: None,
                node: String::new(),
                node_selector: Default::default(),
                lifetime: None,
            }),
            stopped: false,
        },
    );
    // Defaults: empty workspace (the gateway's "default"), the generated name, no resources.
    check_create(
        &["create", "--", "sleep", "60"],
        CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "sbx-generated".into(),
            spec: Some(SandboxSpec {
                command: strings(&["sleep", "60"]),
                ..SandboxSpec::default()
            }),
            stopped: false,
        },
    );
    // Memory alone still sends resources, with cpu 0 (no limit).
    check_create(
        &["create", "--memory", "1G", "--", "true"],
        CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "sbx-generated".into(),
            spec: Some(SandboxSpec {
                command: strings(&["true"]),
                resources: Some(Resources {
                    cpu_millis: 0,
                    memory_bytes: 1_000_000_000,
                    disk_bytes: 0,
                }),
                ..SandboxSpec::default()
            }),
            stopped: false,
        },
    );
}

/// `--cpu` in cores or millicores and `--memory` with units reach the request as millicores
/// and bytes.
#[test]
fn resource_quantities_as_people_write_them() {
    for (cpu, memory, millis, bytes) in [
        ("0.5", "512Mi", 500, 512u64 << 20),
        ("500m", "1G", 500, 1_000_000_000),
        ("2", "4096", 2000, 4096),
        ("1.25", "1.5Gi", 1250, 3 << 29),
    ] {
        let argv = ["create", "--cpu", cpu, "--memory", memory, "--", "true"];
        let SandboxCommand::Create(args) = sandbox(&argv) else {
            panic!("argv {argv:?} is not sandbox create");
        };
        let req = create_sandbox_request(&args, "sbx-generated".to_string()).unwrap();
        let resources = req.spec.and_then(|s| s.resources);
        assert_eq!(
            resources,
            Some(Resources {
                cpu_millis: millis,
                memory_bytes: bytes,
                disk_bytes: 0,
            }),
            "--cpu {cpu} --memory {memory}"
        );
    }
}

#[test]
fn sandbox_create_options() {
    let SandboxCommand::Create(args) = sandbox(&["create", "--", "true"]) else {
        panic!("not create");
    };
    assert!(!args.detach);
    assert_eq!(args.timeout, 120);
    assert_eq!(args.output.format, OutputFormat::Table);
    let SandboxCommand::Create(args) =
        sandbox(&["create", "-d", "--timeout", "5", "-o", "json", "--", "true"])
    else {
        panic!("not create");
    };
    assert!(args.detach);
    assert_eq!(args.timeout, 5);
    assert_eq!(args.output.format, OutputFormat::Json);
}

#[test]
fn sandbox_create_takes_the_name_positionally_or_with_n() {
    for argv in [
        &["create", "web", "--", "true"][..],
        &["create", "-n", "web", "--", "true"],
        &["create", "--name", "web", "--", "true"],
    ] {
        let SandboxCommand::Create(args) = sandbox(argv) else {
            panic!("not create");
        };
        let req = create_sandbox_request(&args, "generated".into()).unwrap();
        assert_eq!(req.name, "web", "argv {argv:?}");
        assert_eq!(req.spec.unwrap().command, ["true"], "argv {argv:?}");
        assert_eq!(args.settle, 0, "no settle by default");
    }
    check_usage_error(
        &["sandbox", "create", "web", "-n", "db", "--", "true"],
        "cannot be used with",
    );
    check_usage_error(
        &["sandbox", "create", "Web", "--", "true"],
        sbx_proto::names::NAME_RULE,
    );
}

#[test]
fn sandbox_create_refuses_duplicate_keys() {
    let SandboxCommand::Create(args) = sandbox(&["create", "-l", "a=1", "-l", "a=2", "--", "x"])
    else {
        panic!("not create");
    };
    let err = create_sandbox_request(&args, "n".into()).unwrap_err();
    assert_eq!(err.to_string(), "--label \"a\" given more than once");
}

#[test]
fn usage_errors() {
    let rule = sbx_proto::names::NAME_RULE;
    check_usage_error(&["sandbox", "create", "--name", "Web", "--", "x"], rule);
    check_usage_error(&["sandbox", "create", "-w", "a_b", "--", "x"], rule);
    check_usage_error(&["sandbox", "get", "-bad-"], "unexpected argument");
    check_usage_error(&["sandbox", "get", "web-"], rule);
    check_usage_error(&["workspace", "create", ""], rule);
    check_usage_error(
        &["sandbox", "create", "--memory", "12Q", "--", "x"],
        "invalid value '12Q' for '--memory <SIZE>': expected bytes",
    );
    check_usage_error(
        &["sandbox", "create", "--cpu", "0.0005", "--", "x"],
        "invalid value '0.0005' for '--cpu <CPU>': expected cores",
    );
    check_usage_error(
        &["sandbox", "create", "--label", "novalue", "--", "x"],
        "KEY=VALUE",
    );
    check_usage_error(
        &["sandbox", "create", "--env", "=v", "--", "x"],
        "KEY=VALUE",
    );
    check_usage_error(&["image", "get", "Bad Ref"], "\"Bad Ref\"");
    check_usage_error(
        &["image", "pull", "busybox", "--username", "u"],
        "--password-stdin",
    );
    check_usage_error(
        &["image", "rm", "busybox", "--id", ID],
        "cannot be used with",
    );
    check_usage_error(
        &["image", "import", "f.tar", "--name", "x@sha256:1"],
        "x@sha256:1",
    );
    check_usage_error(&["image", "get"], "required");
    check_usage_error(&["sandbox", "create", "sleep", "1"], "unexpected argument");
    check_usage_error(&["sandbox", "get"], "required");
    check_usage_error(
        &["sandbox", "get", "web", "--id", ID],
        "cannot be used with",
    );
    check_usage_error(
        &["sandbox", "stop", "--id", ID, "-w", "a"],
        "cannot be used with",
    );
    check_usage_error(&["sandbox", "start", "--id", "not-a-uuid"], "--id");
    check_usage_error(&["sandbox", "list", "-A", "-w", "a"], "cannot be used with");
    check_usage_error(
        &["sandbox", "watch", "-A", "-w", "a"],
        "cannot be used with",
    );
    check_usage_error(&["sandbox", "exec", "web"], "CMD");
    check_usage_error(&["sandbox", "exec", "web", "-o", "json", "--", "x"], "-o");
    check_usage_error(&["sandbox", "get", "web", "-o", "xml"], "xml");
    check_usage_error(&["workspace", "delete"], "required");
    check_usage_error(
        &["workspace", "get", "a", "--id", ID],
        "cannot be used with",
    );
}

#[test]
fn sandbox_refs_by_name_and_by_id() {
    let cases: &[(&[&str], SandboxRef)] = &[
        (
            &["get", "web"],
            SandboxRef {
                id: String::new(),
                workspace: String::new(),
                name: "web".into(),
            },
        ),
        (
            &["stop", "-w", "team-a", "web"],
            SandboxRef {
                id: String::new(),
                workspace: "team-a".into(),
                name: "web".into(),
            },
        ),
        // An id is sent alone: no workspace, no name to fall back on.
        (
            &["delete", "--id", ID],
            SandboxRef {
                id: ID.into(),
                workspace: String::new(),
                name: String::new(),
            },
        ),
        (
            &["restart", "--id", &ID.to_uppercase()],
            SandboxRef {
                id: ID.into(),
                workspace: String::new(),
                name: String::new(),
            },
        ),
    ];
    for (argv, expected) in cases {
        let args = match sandbox(argv) {
            SandboxCommand::Get(a) | SandboxCommand::Delete(a) => a,
            SandboxCommand::Stop(a) | SandboxCommand::Start(a) | SandboxCommand::Restart(a) => {
                a.target
            }
            other => panic!("argv {argv:?} parsed as {other:?}"),
        };
        assert_eq!(
            &sandbox_ref(&args.scope, &args.target),
            expected,
            "argv {argv:?}"
        );
    }
}

#[test]
fn workspace_requests() {
    let WorkspaceCommand::Delete(args) = workspace(&["delete", "--cascade", "--id", ID]) else {
        panic!("not delete");
    };
    let req = delete_workspace_request(&args);
    assert!(req.cascade);
    assert_eq!(
        req.workspace,
        Some(WorkspaceRef {
            id: ID.into(),
            name: String::new()
        })
    );

    let WorkspaceCommand::Get(args) = workspace(&["get", "team-a", "-o", "yaml"]) else {
        panic!("not get");
    };
    assert_eq!(args.output.format, OutputFormat::Yaml);
    assert_eq!(
        workspace_ref(&args.target),
        WorkspaceRef {
            id: String::new(),
            name: "team-a".into()
        }
    );

    let WorkspaceCommand::Create(args) = workspace(&["create", "team-a", "-l", "env=prod"]) else {
        panic!("not create");
    };
    let req = create_workspace_request(&args).unwrap();
    assert_eq!(req.name, "team-a");
    assert_eq!(req.labels, map(&[("env", "prod")]));

    let WorkspaceCommand::List(args) = workspace(&["ls", "-l", "env=prod"]) else {
        panic!("not list");
    };
    let req = list_workspaces_request(&args, "tok");
    assert_eq!(req.label_selector, "env=prod");
    assert_eq!(req.page_token, "tok");
}

#[test]
fn list_exec_logs_watch_requests() {
    let SandboxCommand::List(args) = sandbox(&["list", "-A", "--selector", "app=web"]) else {
        panic!("not list");
    };
    let req = list_sandboxes_request(&args, "");
    assert!(req.all_workspaces);
    assert_eq!(req.label_selector, "app=web");

    let SandboxCommand::Exec(args) = sandbox(&[
        "exec",
        "-w",
        "team-a",
        "web",
        "--timeout",
        "9",
        "-e",
        "X=1",
        "--",
        "sh",
        "-c",
        "exit 3",
    ]) else {
        panic!("not exec");
    };
    assert_eq!(
        exec_request(&args, None).unwrap(),
        ExecRequest {
            sandbox: Some(SandboxRef {
                id: String::new(),
                workspace: "team-a".into(),
                name: "web".into(),
            }),
            command: strings(&["sh", "-c", "exit 3"]),
            env: map(&[("X", "1")]),
            timeout_seconds: 9,
            ..Default::default()
        }
    );

    // -i, -t (combined, as with docker) and --workdir; the terminal is what the caller read.
    let SandboxCommand::Exec(args) =
        sandbox(&["exec", "-it", "--workdir", "/tmp", "web", "--", "sh"])
    else {
        panic!("not exec");
    };
    let tty = Tty {
        rows: 33,
        cols: 77,
        term: "vt100".into(),
    };
    let req = exec_request(&args, Some(tty.clone())).unwrap();
    assert!(req.stdin);
    assert_eq!(req.tty, Some(tty));
    assert_eq!(req.workdir, "/tmp");
    assert_eq!(req.command, strings(&["sh"]));
    // Without -i no stdin is sent, without -t no terminal, without --workdir the sandbox's own.
    let SandboxCommand::Exec(args) = sandbox(&["exec", "web", "--", "cat"]) else {
        panic!("not exec");
    };
    assert!(!args.tty);
    let req = exec_request(&args, None).unwrap();
    assert!(!req.stdin);
    assert_eq!(req.tty, None);
    assert_eq!(req.workdir, "");
    assert_eq!(req.user, "", "no -u: the sandbox's default user");
    // -u / --user, as docker's.
    for flag in ["-u", "--user"] {
        let SandboxCommand::Exec(args) = sandbox(&["exec", flag, "app:staff", "web", "--", "id"])
        else {
            panic!("not exec");
        };
        assert_eq!(exec_request(&args, None).unwrap().user, "app:staff");
    }
    let SandboxCommand::Exec(args) = sandbox(&["exec", "--stdin", "--tty", "web", "--", "x"])
    else {
        panic!("not exec");
    };
    assert!(args.stdin && args.tty);

    let SandboxCommand::Logs(args) = sandbox(&["logs", "-f", "--tail", "10", "--id", ID]) else {
        panic!("not logs");
    };
    assert_eq!(
        logs_request(&args),
        LogsRequest {
            sandbox: Some(SandboxRef {
                id: ID.into(),
                workspace: String::new(),
                name: String::new(),
            }),
            follow: true,
            tail_lines: 10,
            timestamps: false,
            since: None,
        }
    );
    // --since: a duration counts back from now; a time is taken as it is.
    let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_772_359_200);
    let since = |when: &str| {
        let SandboxCommand::Logs(args) = sandbox(&["logs", "-t", "--since", when, "box"]) else {
            panic!("not logs");
        };
        let req = logs_request_at(&args, now);
        assert!(req.timestamps);
        let since = req.since.expect("since");
        (since.seconds, since.nanos)
    };
    assert_eq!(since("10m"), (1_772_359_200 - 600, 0));
    assert_eq!(since("1h30m"), (1_772_359_200 - 5400, 0));
    assert_eq!(since("48h"), (1_772_359_200 - 2 * 86_400, 0));
    assert_eq!(since("0s"), (1_772_359_200, 0));
    assert_eq!(
        since("2026-03-01T09:00:00.5Z"),
        (1_772_355_600, 500_000_000)
    );
    assert_eq!(since("2026-03-01T10:00:00+01:00"), (1_772_355_600, 0));
    for bad in [
        "",
        "m",
        "10x",
        "11d",
        "-5m",
        "1.5h",
        "yesterday",
        "2026-13-01T00:00:00Z",
    ] {
        let err = parse_since(bad).unwrap_err();
        assert!(
            err.contains("duration ago") && err.contains("RFC 3339"),
            "{bad:?}: {err}"
        );
    }
    let err =
        Cli::try_parse_from(["sbx", "sandbox", "logs", "--since", "soon", "box"]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    assert!(err.to_string().contains("neither a duration ago"), "{err}");

    let SandboxCommand::Watch(args) = sandbox(&[
        "watch",
        "-w",
        "team-a",
        "--resource-version",
        "42",
        "-o",
        "json",
    ]) else {
        panic!("not watch");
    };
    assert_eq!(
        watch_request(&args),
        WatchSandboxesRequest {
            workspace: "team-a".into(),
            all_workspaces: false,
            label_selector: String::new(),
            resource_version: 42,
        }
    );
}

#[test]
fn endpoint_flag_env_and_default() {
    use crate::config::{Given, resolve};
    let cli = parse(&["sandbox", "get", "x", "--endpoint", "http://10.0.0.1:9"]);
    assert_eq!(cli.endpoint.as_deref(), Some("http://10.0.0.1:9"));
    let cli = parse(&["--endpoint", "h:1", "workspace", "ls"]);
    assert_eq!(cli.endpoint.as_deref(), Some("h:1"));
    assert_eq!(parse(&["sandbox", "get", "x"]).endpoint, None);
    let endpoint = |flag: Option<&str>, env: Option<&str>| {
        let given = Given {
            endpoint_flag: flag.map(String::from),
            endpoint_env: env.map(String::from),
            ..Given::default()
        };
        resolve(&given, None, std::path::Path::new("/"), || {
            crate::config::default_sockets_for(Some("/default".into()))
        })
        .unwrap()
        .endpoint()
    };
    let service = format!("unix://{}", crate::config::SERVICE_SOCKET);
    assert_eq!(endpoint(Some("a:1"), Some("b:2")), "http://a:1");
    assert_eq!(endpoint(None, Some("b:2")), "http://b:2");
    // With neither, the first default socket there (here neither is: the first is shown).
    assert_eq!(endpoint(None, Some("")), service);
    assert_eq!(endpoint(Some(" "), None), service);
    assert_eq!(endpoint(None, None), service);
    // The defaults: the package's service socket, then sbxd's in the default data dir.
    let (sockets, _) = crate::config::default_sockets();
    let dir = sbx_proto::local::default_data_dir(rustix::process::geteuid().is_root()).unwrap();
    let paths: Vec<_> = sockets.into_iter().map(|s| s.path).collect();
    assert_eq!(
        paths,
        [
            std::path::PathBuf::from(crate::config::SERVICE_SOCKET),
            dir.join("sbxd.sock")
        ]
    );
}

#[test]
fn generated_names_are_valid_and_varied() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let names: HashSet<String> = (0..200).map(|_| generate_sandbox_name(&mut rng)).collect();
    assert_eq!(names.len(), 200, "200 draws should not collide");
    for name in &names {
        assert!(name.starts_with("sbx-") && name.len() == 12, "{name}");
        sbx_proto::names::validate_name(name).unwrap();
    }
    let mut thread_rng = rand::rng();
    sbx_proto::names::validate_name(&generate_sandbox_name(&mut thread_rng)).unwrap();
}

#[test]
fn references_read_well_in_messages() {
    let by_name = SandboxRef {
        id: String::new(),
        workspace: String::new(),
        name: "web".into(),
    };
    assert_eq!(
        describe_sandbox_ref(&by_name),
        "sandbox \"web\" in workspace \"default\""
    );
    let by_id = SandboxRef {
        id: ID.into(),
        ..by_name
    };
    assert_eq!(describe_sandbox_ref(&by_id), format!("sandbox {ID}"));
    assert_eq!(
        describe_workspace_ref(&WorkspaceRef {
            id: String::new(),
            name: "a".into()
        }),
        "workspace \"a\""
    );
}

fn image(argv: &[&str]) -> ImageCommand {
    let mut full = vec!["image"];
    full.extend_from_slice(argv);
    match parse(&full).command {
        Command::Image(cmd) => cmd,
        other => panic!("argv {argv:?} parsed as {other:?}"),
    }
}

#[test]
fn image_commands_build_their_requests() {
    let ImageCommand::Pull(args) = image(&[
        "pull",
        "localhost:5000/app:v1",
        "--insecure",
        "--username",
        "me",
        "--password-stdin",
    ]) else {
        panic!("not pull");
    };
    assert_eq!(
        pull_image_request(&args, Some("secret".into())),
        PullImageRequest {
            reference: "localhost:5000/app:v1".into(),
            insecure: true,
            username: "me".into(),
            password: "secret".into(),
            workspace: String::new(),
            publish: false,
        }
    );
    let ImageCommand::Pull(args) = image(&["pull", "busybox"]) else {
        panic!("not pull");
    };
    assert_eq!(pull_image_request(&args, None).username, "");
    let digest = format!("sha256:{}", "a".repeat(64));
    let ImageCommand::Get(args) = image(&["get", &digest, "-o", "json"]) else {
        panic!("not get");
    };
    assert_eq!(image_ref(&args.target, None).reference, digest);
    assert_eq!(args.output.format, OutputFormat::Json);
    let ImageCommand::Delete(args) = image(&["rm", "--id", ID]) else {
        panic!("not delete");
    };
    let by_id = image_ref(&args.target, args.workspace.as_deref());
    assert_eq!((by_id.id.as_str(), by_id.reference.as_str()), (ID, ""));
    assert_eq!(describe_image_ref(&by_id), format!("image with id {ID}"));
    let ImageCommand::Import(args) = image(&["import", "dir/", "--name", "app:v1"]) else {
        panic!("not import");
    };
    assert_eq!(args.name.as_deref(), Some("app:v1"));
    assert_eq!(args.path, std::path::PathBuf::from("dir/"));
}

#[test]
fn a_create_may_leave_the_command_to_the_image() {
    let SandboxCommand::Create(args) = sandbox(&["create", "--image", "busybox"]) else {
        panic!("not create");
    };
    let req = create_sandbox_request(&args, "sbx-generated".into()).unwrap();
    let spec = req.spec.unwrap();
    assert!(spec.command.is_empty());
    assert_eq!(spec.image, "busybox");
    assert_eq!(spec.image_digest, "", "the pin is the gateway's to set");
}

#[test]
fn a_command_without_its_separator_gets_a_hint() {
    let argv = |line: &str| -> Vec<String> { line.split_whitespace().map(String::from).collect() };
    let kind = |line: &str| {
        Cli::try_parse_from(std::iter::once("sbx".to_string()).chain(argv(line)))
            .unwrap_err()
            .kind()
    };
    for line in [
        "sandbox exec web ls -l",
        "sandbox create web sleep 1",
        "run --rm img echo hi",
    ] {
        let hint = crate::missing_separator_hint(kind(line), &argv(line))
            .unwrap_or_else(|| panic!("no hint for {line:?}"));
        assert!(hint.contains("goes after `--`"), "{hint}");
    }
    // Other usage errors get none.
    let line = "sandbox list --nope";
    assert_eq!(crate::missing_separator_hint(kind(line), &argv(line)), None);
}
