//! A service endpoint's request, as an adapter: its Host to an endpoint
//! (`FrontDoor::route_service`), then the request over a connection the front door forwards
//! to the endpoint's port (`FrontDoor::forward_request`, by nobody authenticated: a paused
//! sandbox wakes only as its `wake_on_request` allows), each failure answered in the
//! listener's own words.

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use crate::daemon::connections::ConnProof;
use crate::frontdoor::routes::MISDIRECTED;
use crate::frontdoor::{Class, Failure, FrontDoor};
use crate::http::{Body, bridge, host_of, text};

/// One request: its Host to an endpoint, then the request over a fresh forwarded connection.
pub(super) async fn route(front: &FrontDoor, req: Request<Incoming>) -> Response<Body> {
    let host = host_of(&req);
    let target = match front.route_service(&host).await {
        Ok(t) => t,
        Err(failure) => return text(route_status(&failure), failure.message),
    };
    // A request that reaches an exposed service is what this listener is for: the
    // connection has proven itself (connections::ConnProof).
    if let Some(proof) = req.extensions().get::<ConnProof>() {
        proof.prove();
    }
    let (up, input) = bridge::inputs();
    match front
        .forward_request(None, target.sandbox_id, target.port, input)
        .await
    {
        Ok(output) => bridge::send(req, up, output, target.sandbox_id, target.port).await,
        Err(failure) => bridge::refused(&failure),
    }
}

/// The status of a Host that routes nowhere: 421 under another domain, 404 naming no
/// endpoint, 409 naming two, 503 while the gateway cannot tell.
fn route_status(failure: &Failure) -> StatusCode {
    match failure.class {
        Class::NotFound if failure.reason == MISDIRECTED => StatusCode::MISDIRECTED_REQUEST,
        Class::NotFound => StatusCode::NOT_FOUND,
        Class::FailedPrecondition => StatusCode::CONFLICT,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use sbx_actors::ActorError;

    use super::*;
    use crate::frontdoor::routes::route_failure;

    async fn answer(response: Response<Body>) -> (u16, String) {
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    /// Every error a Host's routing meets, answered as this listener always has: the status
    /// and the actor's text on one line.
    #[tokio::test]
    async fn a_host_that_routes_nowhere_is_answered_in_the_listeners_words() {
        let not_found = |what: &str| ActorError::ObjectNotFound {
            kind: "service",
            what: what.to_string(),
        };
        let cases = [
            (
                not_found("for Host \"a.example\" (not under svc.test)"),
                421,
                "service for Host \"a.example\" (not under svc.test) not found\n",
            ),
            (
                not_found("for Host \"web.svc.test\""),
                404,
                "service for Host \"web.svc.test\" not found\n",
            ),
            (ActorError::WorkspaceNotFound("\"w\"".into()), 404, ""),
            (
                ActorError::SandboxNotFound {
                    what: "\"s\" in workspace \"w\"".into(),
                    hint: String::new(),
                    similar: Vec::new(),
                },
                404,
                "",
            ),
            (
                ActorError::FailedPrecondition("Host \"a--b--c--d.svc.test\" names more".into()),
                409,
                "",
            ),
            (ActorError::StoreUnavailable("down".into()), 503, ""),
            (
                ActorError::Internal("service x has no owner".into()),
                503,
                "",
            ),
        ];
        for (err, status, body) in cases {
            let text_of = err.to_string();
            let failure = route_failure(err);
            let (got, got_body) =
                answer(text(route_status(&failure), failure.message.clone())).await;
            assert_eq!(got, status, "{text_of}");
            assert_eq!(got_body, format!("{text_of}\n"));
            if !body.is_empty() {
                assert_eq!(got_body, body);
            }
        }
    }

    /// A forward another gateway of the store would serve is 503 naming no gateway; any other
    /// refusal 502 with the actor's text.
    #[tokio::test]
    async fn a_forward_held_elsewhere_names_no_gateway() {
        let held = Failure::from(ActorError::HeldElsewhere {
            workspace: uuid::Uuid::nil(),
            gateway: uuid::Uuid::max(),
            address: "https://10.9.8.7:7443".into(),
        });
        let (status, body) = answer(bridge::refused(&held)).await;
        assert_eq!(status, 503);
        assert_eq!(
            body,
            "this sandbox is served by another gateway of the store; send its service \
             requests to that gateway\n"
        );
        let not_ready = ActorError::FailedPrecondition("sandbox s is not Ready".into());
        let said = format!("{not_ready}\n");
        let refused = bridge::refused(&Failure::from(not_ready));
        assert_eq!(answer(refused).await, (502, said));
    }
}
