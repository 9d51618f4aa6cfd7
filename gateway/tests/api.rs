//! The gRPC API beyond errors: pagination and ids across the wire (sim driver).

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{DataDir, Sbxd};
use futures::StreamExt;
use sbx_proto::v1::{CreateSandboxRequest, ListSandboxesRequest, SandboxSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_page_through_every_sandbox_once() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    let mut created = HashSet::new();
    for i in 0..5 {
        let mut spec = SandboxSpec {
            command: vec!["sleep".into(), "1000".into()],
            ..Default::default()
        };
        spec.labels.insert(
            "parity".into(),
            if i % 2 == 0 { "even" } else { "odd" }.into(),
        );
        let s = sb
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: String::new(),
                name: format!("p{i}"),
                spec: Some(spec),
                stopped: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(uuid::Uuid::parse_str(&s.id).is_ok(), "{s:?}");
        assert!(created.insert(s.id));
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = sb
            .list_sandboxes(ListSandboxesRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(page.sandboxes.len() <= 2);
        seen.extend(page.sandboxes.into_iter().map(|s| s.id));
        if page.next_page_token.is_empty() {
            break;
        }
        assert_ne!(page.next_page_token, token, "the token must move");
        token = page.next_page_token;
        assert!(pages < 10, "pagination does not end");
    }
    assert_eq!(pages, 3);
    assert_eq!(seen.len(), 5, "each sandbox exactly once: {seen:?}");
    assert_eq!(seen.iter().cloned().collect::<HashSet<_>>(), created);

    // An oversized page is capped, not refused; a selector filters.
    let all = sb
        .list_sandboxes(ListSandboxesRequest {
            page_size: 1_000_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.sandboxes.len(), 5);
    assert!(all.next_page_token.is_empty());
    let even = sb
        .list_sandboxes(ListSandboxesRequest {
            label_selector: "parity=even".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let names: HashSet<String> = even.sandboxes.into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["p0", "p2", "p4"].map(String::from).into());
    d.assert_healthy().await;
}

/// Reflection (v1) lists the sbx.v1 services and health.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let names = reflection_services(&d.endpoint()).await;
    for wanted in [
        "sbx.v1.WorkspaceService",
        "sbx.v1.SandboxService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.iter().any(|n| n == wanted),
            "{wanted} not in {names:?}"
        );
    }
}

async fn reflection_services(endpoint: &str) -> Vec<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let channel = tonic::transport::Channel::from_shared(endpoint.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(futures::stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let response = tokio::time::timeout(Duration::from_secs(10), responses.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}
