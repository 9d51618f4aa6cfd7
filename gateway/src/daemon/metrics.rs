//! `sbxd serve --metrics-listen ADDR`: the gateway's metrics for Prometheus, over HTTP/1.1 at
//! `GET /metrics` in the OpenMetrics text format (`prometheus-client`, the Prometheus
//! project's own Rust crate: its encoder writes what Prometheus and its parsers read, so no
//! format is written by hand here). Without authentication, so on a loopback address only:
//! one off this machine is refused at start (a scraper elsewhere reaches it through a proxy
//! that adds TLS and authentication).
//!
//! [`ApiMetricsLayer`] counts the API's requests by method and status code, and their latency,
//! around every service (authentication included, so a refused caller counts too). The method
//! label is one this gateway serves or `other` (`auth::method_label`), and a call refused as
//! unauthenticated is counted as `unauthenticated` whatever it named: a stranger cannot grow
//! the label set by what it sends (20,000 calls to `/sbx.<uuid>/M` once took `/metrics` from
//! 55 KB to 43 MB).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use sbx_actors::Gateway;
use sbx_actors::metrics::{ApiLabels, MethodLabels, Metrics};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::codegen::{Service, http};

/// The content type of the OpenMetrics text format.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What `GET /metrics` answers: the exposition, its states read now.
pub type Render =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync + 'static>;

/// A gateway's exposition ([`Gateway::metrics_text`]).
pub fn of_gateway(gateway: Arc<Gateway>) -> Render {
    Arc::new(move || {
        let gateway = Arc::clone(&gateway);
        Box::pin(async move { gateway.metrics_text().await })
    })
}

/// Serves `GET /metrics` on `listener` (under `limits`) until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    limits: super::connections::Limits,
    render: Render,
    shutdown: CancellationToken,
) {
    crate::http::serve_http1(listener, "metrics", None, limits, shutdown, move |req| {
        let render = Arc::clone(&render);
        async move { answer(&render, &req).await }
    })
    .await
}

async fn answer<B>(render: &Render, req: &Request<B>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&hyper::Method::GET, "/metrics") => {
            // A scrape (on loopback, where the metrics are): what this listener is for.
            if let Some(proof) = req.extensions().get::<super::connections::ConnProof>() {
                proof.prove();
            }
            (StatusCode::OK, CONTENT_TYPE, render().await)
        }
        (_, "/metrics") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "GET /metrics only\n".to_string(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "the metrics are at /metrics\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        content_type.parse().expect("a header value"),
    );
    response
}

/// Counts every API request (method, status code at the answer's head, latency).
#[derive(Clone)]
pub struct ApiMetricsLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for ApiMetricsLayer {
    type Service = ApiMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiMetricsService {
            inner,
            metrics: Arc::clone(&self.0),
        }
    }
}

#[derive(Clone)]
pub struct ApiMetricsService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ApiMetricsService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        if !self.metrics.enabled() {
            return Box::pin(self.inner.call(req));
        }
        let began = Instant::now();
        // A path no method has is counted under one name: a caller cannot grow the families.
        let method = crate::auth::method_label(req.uri().path()).to_string();
        let answer = self.inner.call(req);
        let metrics = Arc::clone(&self.metrics);
        Box::pin(async move {
            let response = answer.await?;
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from_i32);
            // A stranger's call is counted, never labelled by what it named.
            let method = if code == tonic::Code::Unauthenticated {
                "unauthenticated".to_string()
            } else {
                method
            };
            metrics
                .api_requests
                .get_or_create(&ApiLabels {
                    method: method.clone(),
                    code: crate::grpc::status::code_name(code).to_string(),
                })
                .inc();
            metrics
                .api_duration
                .get_or_create(&MethodLabels { method })
                .observe(began.elapsed().as_secs_f64());
            Ok(response)
        })
    }
}

/// Whether `addr` may serve the metrics: a loopback address only (they are not authenticated).
pub fn check_listen(addr: &std::net::SocketAddr) -> Result<(), String> {
    if addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(format!(
            "--metrics-listen {addr} is not a loopback address: the metrics are served without \
             authentication; serve them on 127.0.0.1 or ::1 and put a proxy with TLS and \
             authentication in front for a scraper elsewhere"
        ))
    }
}
