//! Scraping `/metrics` in the tests: over HTTP, parsed by the Prometheus project's own
//! OpenMetrics parser (Debian's `python3-prometheus-client`), strict, no series twice.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Debian's interpreter, where `python3-prometheus-client` is installed.
const PYTHON: &str = "/usr/bin/python3";

/// Parses an exposition with the OpenMetrics parser; every sample as (name, labels, value).
/// Fails on a parse error or a series given twice.
const PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
seen, out = set(), []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        if key in seen:
            sys.exit(f"series given twice: {key}")
        seen.add(key)
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;

pub type Samples = Vec<(String, BTreeMap<String, String>, f64)>;

/// GET /metrics, parsed.
pub async fn scrape(addr: &str) -> Samples {
    let text = tokio::task::spawn_blocking({
        let addr = addr.to_string();
        move || {
            use std::io::Read as _;
            let mut conn = std::net::TcpStream::connect(&addr).expect("connect to the metrics");
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut text = String::new();
            conn.read_to_string(&mut text).expect("the answer, whole");
            text
        }
    })
    .await
    .unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    let mut parser = Command::new(PYTHON)
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 with prometheus_client (apt-get install python3-prometheus-client)");
    parser
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = parser.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the parser refused the exposition: {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The value of the sample `name` whose labels include `labels` (0 when absent).
pub fn value(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// sbxd on `data` with `driver` and `extra` flags, serving its metrics on a loopback port of
/// its own choosing, and that port's address.
pub fn start_with_metrics(
    data: &std::path::Path,
    driver: &str,
    extra: &[&str],
) -> (super::Sbxd, String) {
    let addr_file = data.join("metrics-addr");
    let mut flags = extra.to_vec();
    flags.extend([
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-addr-file",
        addr_file.to_str().expect("a UTF-8 path"),
    ]);
    let d = super::Sbxd::start(data, driver, &flags);
    let addr = std::fs::read_to_string(&addr_file)
        .expect("the metrics address file")
        .trim()
        .to_string();
    (d, addr)
}
