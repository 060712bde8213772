//! The loopback HTTP listener of an instance: `/health`, `/ready` and `/metrics`.
//!
//! One listener (`http.address`, default `127.0.0.1:9464`; `off` for none; port 0 picks a
//! free port, logged as `http listening`), served by hyper on a thread of its own, so a
//! busy or stuck run loop never delays an answer:
//!
//! - `GET /health`: 200 while the run loop turns (or is still starting); 503 when it has
//!   not turned for the stuck limit (60 s), or the run stopped or failed (the error is in
//!   the body).
//! - `GET /ready`: 200 only when the group gave this instance its partitions and every one
//!   is restored and processing, and a broker is reachable (see [`crate::kafka::link`]);
//!   otherwise 503. The body (JSON) lists the assigned partitions (`assigned`: of the
//!   repartition topic with a repartition hop), the source partitions routed to a
//!   repartition topic (`routing`: `{"topic", "partition"}`), those waiting to restore,
//!   and each restoring store partition with `done` / `total` records, `rate` (records/s)
//!   and `eta_seconds`.
//! - `GET /metrics`: the Prometheus text format (the names in [`crate::metrics`]).

use crate::error::{Error, Result};
use crate::runtime::status::{Phase, Status};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// What a binary does at start-up: a fresh [`Status`] for the run, and unless
/// `http.address` is `off`, the Prometheus recorder installed and the listener serving it.
/// Pass the status to [`crate::runtime::RunOptions::status`].
///
/// # Errors
/// As [`serve`] and [`crate::metrics::install_prometheus`].
pub(crate) fn start(config: &crate::config::Config) -> Result<Arc<Status>> {
    let status = Arc::new(Status::default());
    if let Some(addr) = config.http_address {
        let metrics = crate::metrics::install_prometheus()?;
        serve(addr, status.clone(), Some(metrics))?;
    }
    Ok(status)
}

/// Bind `addr` and serve `/health`, `/ready` (from `status`) and `/metrics` (from
/// `metrics`, 404 when `None`) on a background thread for the life of the process.
/// Returns the bound address (the chosen port when `addr` has port 0).
///
/// # Errors
/// [`Error::Config`] naming `http.address` when the address cannot be bound (in use, not
/// local).
pub(crate) fn serve(
    addr: SocketAddr,
    status: Arc<Status>,
    metrics: Option<PrometheusHandle>,
) -> Result<SocketAddr> {
    let bad = |e: std::io::Error| {
        Error::Config(format!(
            "http.address {addr}: {e}; set http.address to a free host:port, port 0 for any, or off"
        ))
    };
    let listener = std::net::TcpListener::bind(addr).map_err(bad)?;
    listener.set_nonblocking(true).map_err(bad)?;
    let bound = listener.local_addr().map_err(bad)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(bad)?;
    std::thread::Builder::new()
        .name("onceflow-http".into())
        .spawn(move || rt.block_on(accept_loop(listener, status, metrics)))
        .map_err(bad)?;
    tracing::info!(address = %bound, "http listening (/health, /ready, /metrics)");
    Ok(bound)
}

async fn accept_loop(
    listener: std::net::TcpListener,
    status: Arc<Status>,
    metrics: Option<PrometheusHandle>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "http listener failed");
            return;
        }
    };
    if let Some(h) = metrics.clone() {
        // Histograms and summaries are drained by upkeep; without a scrape they would grow.
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                h.run_upkeep();
            }
        });
    }
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let status = status.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let r = route(&req, &status, metrics.as_ref());
                async move { Ok::<_, Infallible>(r) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!(error = %e, "http connection ended");
            }
        });
    }
}

fn respond(code: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Starting => "starting",
        Phase::Running => "running",
        Phase::Stopped => "stopped",
        Phase::Failed => "failed",
    }
}

fn route<B>(
    req: &Request<B>,
    status: &Status,
    metrics: Option<&PrometheusHandle>,
) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    match req.uri().path() {
        "/health" => {
            let h = status.health();
            let body = serde_json::json!({
                "healthy": h.healthy,
                "phase": phase_name(h.phase),
                "since_last_turn_ms": h.since_last_turn_ms,
                "error": h.failure,
            });
            let code = if h.healthy {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            respond(code, JSON, format!("{body}\n"))
        }
        "/ready" => {
            let phase = status.phase();
            let p = status.partitions();
            let broker = crate::kafka::link::reachable();
            let ready = phase == Phase::Running && p.ready() && broker;
            let restoring: Vec<serde_json::Value> = p
                .restoring
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "store": r.store,
                        "partition": r.partition,
                        "done": r.progress.done,
                        "total": r.progress.total,
                        "remaining": r.progress.remaining,
                        "rate": (r.progress.rate * 10.0).round() / 10.0,
                        "eta_seconds": (r.progress.eta_seconds * 10.0).round() / 10.0,
                    })
                })
                .collect();
            let body = serde_json::json!({
                "ready": ready,
                "phase": phase_name(phase),
                "broker_reachable": broker,
                "assignment_received": p.assigned_once,
                "assigned": p.assigned,
                "routing": p.routing.iter().map(|(t, q)| serde_json::json!({"topic": t, "partition": q})).collect::<Vec<_>>(),
                "waiting": p.waiting,
                "routing_waiting": p.routing_waiting.iter().map(|(t, q)| serde_json::json!({"topic": t, "partition": q})).collect::<Vec<_>>(),
                "restoring": restoring,
            });
            let code = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            respond(code, JSON, format!("{body}\n"))
        }
        "/metrics" => match metrics {
            Some(h) => respond(StatusCode::OK, "text/plain; version=0.0.4", h.render()),
            None => respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                "no metrics recorder installed in this process\n".into(),
            ),
        },
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /health, /ready or /metrics\n".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::status::{Partitions, Restoring};
    use crate::state::restore::Progress;

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
            let code = r.status().as_u16();
            (code, r.text().await.unwrap())
        })
    }

    #[test]
    fn endpoints_answer_from_the_status() {
        let status = Arc::new(Status::default());
        let addr = serve("127.0.0.1:0".parse().unwrap(), status.clone(), None).unwrap();
        assert_ne!(addr.port(), 0);
        let (code, body) = get(addr, "/ready");
        assert_eq!(code, 503, "{body}");
        status.beat();
        status.publish(Partitions {
            assigned_once: true,
            assigned: vec![0],
            routing: vec![("in".into(), 2)],
            restoring: vec![Restoring {
                store: "dedup".into(),
                partition: 0,
                progress: Progress {
                    done: 40,
                    total: 100,
                    remaining: 60,
                    rate: 20.0,
                    eta_seconds: 3.0,
                },
            }],
            ..Partitions::default()
        });
        let (code, body) = get(addr, "/ready");
        assert_eq!(code, 503);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["restoring"][0]["store"], "dedup");
        assert_eq!(v["restoring"][0]["done"], 40);
        assert_eq!(v["restoring"][0]["total"], 100);
        assert_eq!(v["restoring"][0]["eta_seconds"], 3.0);
        // A router is named by its source topic and partition, not an internal task id.
        assert_eq!(v["assigned"], serde_json::json!([0]));
        assert_eq!(
            v["routing"],
            serde_json::json!([{"topic": "in", "partition": 2}])
        );
        let (code, _) = get(addr, "/health");
        assert_eq!(code, 200);
        status.publish(Partitions {
            assigned_once: true,
            assigned: vec![0],
            ..Partitions::default()
        });
        assert_eq!(get(addr, "/ready").0, 200);
        assert_eq!(get(addr, "/nope").0, 404);
        assert_eq!(get(addr, "/metrics").0, 404, "no recorder given");
        status.finish(Some("fatal".into()));
        let (code, body) = get(addr, "/health");
        assert_eq!(code, 503);
        assert!(body.contains("fatal"), "{body}");
        assert_eq!(get(addr, "/ready").0, 503);
        // A second listener on the same address is refused with a clear error.
        let e = serve(addr, status, None).unwrap_err().to_string();
        assert!(e.contains("http.address"), "{e}");
    }
}
