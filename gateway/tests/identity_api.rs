//! `sbx.v1.IdentityService` through the real sbxd (`--auth token`): a gateway-wide admin
//! makes an identity over the API and gets its token once; the token works at once for what
//! its role allows; a workspace-scoped admin may not make identities; a revoke over the API
//! stops the token at the next call; bad input is INVALID_ARGUMENT or ALREADY_EXISTS; each
//! change and each refusal is an `sbx::audit` line naming who, with no token in the log.

mod common;

use common::{DataDir, Sbxd};
use sbx_proto::v1::identity_service_client::IdentityServiceClient;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateIdentityRequest, ListIdentitiesRequest, ListSandboxesRequest, RevokeIdentityRequest,
};
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// `sbxd token create` on the data dir: the token (its last line).
fn mint(data: &std::path::Path, name: &str, role: &str, workspaces: &[&str]) -> String {
    let mut cmd = common::sbxd_command();
    cmd.args(["token", "create", "--data-dir"])
        .arg(data)
        .args(["--name", name, "--role", role]);
    for ws in workspaces {
        cmd.args(["--workspace", ws]);
    }
    let out = cmd.output().expect("sbxd token create");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .last()
        .expect("a token")
        .to_string()
}

fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {token}")).unwrap(),
    );
    req
}

async fn list_default(channel: &Channel, token: &str) -> Result<usize, Code> {
    SandboxServiceClient::new(channel.clone())
        .list_sandboxes(with_token(ListSandboxesRequest::default(), token))
        .await
        .map(|r| r.into_inner().sandboxes.len())
        .map_err(|s| s.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_makes_and_revokes_identities_over_the_api() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &["--auth", "token"]);
    let root = mint(data.path(), "root", "admin", &[]);
    let team_admin = mint(data.path(), "team-admin", "admin", &["team"]);
    let channel = d.channel().await;
    let mut ids = IdentityServiceClient::new(channel.clone());

    // A gateway-wide admin makes a viewer of "default"; its token works at once.
    let made = ids
        .create_identity(with_token(
            CreateIdentityRequest {
                name: "reader".into(),
                role: "viewer".into(),
                workspaces: vec!["default".into()],
                ttl_seconds: 3600,
                cert_only: false,
                e2b_key: false,
            },
            &root,
        ))
        .await
        .expect("create identity")
        .into_inner();
    let identity = made.identity.expect("the identity");
    assert_eq!(
        (identity.role.as_str(), identity.workspaces.as_slice()),
        ("viewer", &["default".to_string()][..])
    );
    assert!(identity.has_token && identity.expires_at.is_some());
    assert!(made.token.starts_with("sbx_"), "{}", made.token);
    assert_eq!(list_default(&channel, &made.token).await, Ok(0));
    // The token appears nowhere in the listing, nor in the identities file.
    let listed = ids
        .list_identities(with_token(ListIdentitiesRequest {}, &root))
        .await
        .expect("list")
        .into_inner()
        .identities;
    let names: Vec<&str> = listed.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["root", "team-admin", "reader"]);
    let file = std::fs::read_to_string(data.path().join("auth/identities.json")).unwrap();
    assert!(!file.contains(&made.token[4..]));

    // A token in E2B's API-key form, for the E2B SDKs: a token like any other.
    let agent = ids
        .create_identity(with_token(
            CreateIdentityRequest {
                name: "agent".into(),
                role: "viewer".into(),
                workspaces: vec!["default".into()],
                e2b_key: true,
                ..Default::default()
            },
            &root,
        ))
        .await
        .expect("create an identity with an E2B key")
        .into_inner();
    let key = &agent.token;
    assert!(
        key.len() == 44
            && key.starts_with("e2b_")
            && key[4..].chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')),
        "{key}"
    );
    assert_eq!(list_default(&channel, key).await, Ok(0));
    let file = std::fs::read_to_string(data.path().join("auth/identities.json")).unwrap();
    assert!(!file.contains(&key[4..]));

    // Not for a workspace-scoped admin, nor a viewer, nor without a credential.
    for (who, token) in [("team-admin", &team_admin), ("reader", &made.token)] {
        let refused = ids
            .list_identities(with_token(ListIdentitiesRequest {}, token))
            .await
            .expect_err(who);
        assert_eq!(refused.code(), Code::PermissionDenied, "{who}: {refused:?}");
    }
    let anonymous = ids
        .list_identities(ListIdentitiesRequest {})
        .await
        .expect_err("no credential");
    assert_eq!(anonymous.code(), Code::Unauthenticated);

    // Bad input.
    for (name, role, code) in [
        ("Bad_Name", "viewer", Code::InvalidArgument),
        ("ok", "owner", Code::InvalidArgument),
        ("reader", "viewer", Code::AlreadyExists),
    ] {
        let answer = ids
            .create_identity(with_token(
                CreateIdentityRequest {
                    name: name.into(),
                    role: role.into(),
                    ..Default::default()
                },
                &root,
            ))
            .await
            .expect_err(name);
        assert_eq!(answer.code(), code, "{name} {role}: {answer:?}");
    }

    // Revoked over the API: refused at the next call.
    ids.revoke_identity(with_token(
        RevokeIdentityRequest {
            name: "reader".into(),
        },
        &root,
    ))
    .await
    .expect("revoke");
    assert_eq!(
        list_default(&channel, &made.token).await,
        Err(Code::Unauthenticated)
    );
    let reader_token = made.token.clone();
    let unknown = ids
        .revoke_identity(with_token(
            RevokeIdentityRequest {
                name: "reader".into(),
            },
            &root,
        ))
        .await
        .expect_err("revoked twice");
    assert_eq!(unknown.code(), Code::NotFound);

    // The same through `sbx identity`.
    let ep = d.endpoint();
    let made = common::sbx(
        &ep,
        &[
            "--token", &root, "identity", "create", "ci", "--role", "editor", "-w", "default",
        ],
    );
    let token = made.ok().lines().last().expect("the token").to_string();
    assert!(token.starts_with("sbx_"), "{made:?}");
    assert_eq!(list_default(&channel, &token).await, Ok(0));
    let listed = common::sbx(&ep, &["--token", &root, "identity", "list"]);
    assert!(
        listed.ok().contains("ci\teditor\tdefault\ttoken\tnever"),
        "{listed:?}"
    );
    assert!(!listed.stdout.contains(&token[4..]));
    let refused = common::sbx(&ep, &["--token", &token, "identity", "list"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("PERMISSION_DENIED"), "{refused:?}");
    common::sbx(&ep, &["--token", &root, "identity", "revoke", "ci"]).ok();
    assert_eq!(
        list_default(&channel, &token).await,
        Err(Code::Unauthenticated)
    );

    // Audited: who made and revoked what, the outcome, the refusals; never a token.
    let log = d.log_text();
    let audit: Vec<&str> = log.lines().filter(|l| l.contains("sbx::audit")).collect();
    let has = |needles: &[&str]| audit.iter().any(|l| needles.iter().all(|n| l.contains(n)));
    assert!(
        has(&[
            "who=root",
            "action=\"create identity\"",
            "object=\"reader\""
        ]),
        "{audit:#?}"
    );
    assert!(
        has(&[
            "who=root",
            "method=/sbx.v1.IdentityService/RevokeIdentity",
            "outcome=Ok"
        ]),
        "{audit:#?}"
    );
    assert!(
        has(&[
            "method=/sbx.v1.IdentityService/ListIdentities",
            "outcome=Unauthenticated"
        ]),
        "{audit:#?}"
    );
    assert!(
        has(&[
            "who=reader",
            "method=/sbx.v1.IdentityService/ListIdentities",
            "outcome=PermissionDenied"
        ]),
        "{audit:#?}"
    );
    for secret in [&root, &team_admin, &reader_token, &token] {
        assert!(!log.contains(&secret[4..]), "a token is in the log");
    }
}
