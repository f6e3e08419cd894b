//! A follower's API: every request forwarded to the leader (see
//! [`crate::ha`]), on the address and with the TLS the server itself would
//! serve.

use crate::error::ApiError;
use crate::{ServerConfig, tls};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use muster_api::client::FOLLOWER_UNAVAILABLE;
use muster_api::protocol::ErrorCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The leader as the election last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leader {
    /// Its advertised URL (`None`: no leader).
    pub url: Option<String>,
    /// It missed renewals of its lease (stopped, or cut off from the
    /// store): another server takes over unless it renews in time.
    pub silent: bool,
}

struct Forwarding {
    leader: watch::Receiver<Leader>,
    http: reqwest::Client,
}

/// A running forwarder; [`Forwarder::stop`] frees its address.
pub struct Forwarder {
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Headers that belong to one connection, not to the request.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

fn unavailable(message: String) -> Response {
    let mut response = ApiError::new(ErrorCode::Unavailable, message)
        .with_status(StatusCode::SERVICE_UNAVAILABLE)
        .into_response();
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static("1"),
    );
    response
}

async fn forward(State(state): State<Arc<Forwarding>>, request: Request) -> Response {
    let mut watched = state.leader.clone();
    let seen = watched.borrow_and_update().clone();
    let Some(leader) = seen.url else {
        return unavailable(format!(
            "{FOLLOWER_UNAVAILABLE} and no server leads yet (an election is under way); try \
             again in a moment"
        ));
    };
    if seen.silent {
        return unavailable(format!(
            "{FOLLOWER_UNAVAILABLE} and the leader at {leader} has missed renewals of its lease \
             (stopped, or cut off from the store): another server takes over unless it renews \
             in time; try again in a moment"
        ));
    }
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |path| path.as_str())
        .to_string();
    let method = request.method().clone();
    let headers = request.headers().clone();
    let body = match axum::body::to_bytes(request.into_body(), crate::MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(error) => {
            return ApiError::new(
                ErrorCode::InvalidArgument,
                format!("cannot read the request body: {error}"),
            )
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
            .into_response();
        }
    };
    let mut outgoing = HeaderMap::new();
    copy_headers(&headers, &mut outgoing);
    let exchange = async {
        let answer = match state
            .http
            .request(method, format!("{leader}{path}"))
            .headers(outgoing)
            .body(body)
            .send()
            .await
        {
            Ok(answer) => answer,
            Err(error) => {
                return unavailable(format!(
                    "{FOLLOWER_UNAVAILABLE} and the leader at {leader} does not answer \
                     ({error}); try again in a moment"
                ));
            }
        };
        let status = answer.status();
        let mut response_headers = HeaderMap::new();
        copy_headers(answer.headers(), &mut response_headers);
        match answer.bytes().await {
            Ok(bytes) => {
                let mut response = Response::new(Body::from(bytes));
                *response.status_mut() = status;
                *response.headers_mut() = response_headers;
                response
            }
            Err(error) => unavailable(format!(
                "{FOLLOWER_UNAVAILABLE} and the leader at {leader} broke off its answer \
                 ({error}); try again in a moment"
            )),
        }
    };
    // A leader that falls silent (or is replaced) while it holds the
    // request is not waited for: its client hears at once and asks again
    // (a submission with its idempotency key, so a job it did take is
    // answered, never made twice; a deposed leader commits nothing).
    let gave_up = watched.wait_for(|now| now.silent || now.url.as_deref() != Some(leader.as_str()));
    tokio::select! {
        response = exchange => response,
        _ = gave_up => unavailable(format!(
            "{FOLLOWER_UNAVAILABLE} and the leader at {leader} fell silent (it missed renewals \
             of its lease) before it answered: whether it carried the request out is not \
             known; another server takes over unless it renews in time; try again in a moment"
        )),
    }
}

impl Forwarder {
    /// Serves `config.listen` (with the server's TLS), forwarding to the
    /// leader `leader` names.
    pub async fn start(
        config: &ServerConfig,
        leader: watch::Receiver<Leader>,
    ) -> anyhow::Result<Forwarder> {
        use anyhow::Context;
        crate::create_private_dir(&config.data_dir).with_context(|| {
            format!(
                "cannot create the data directory {}",
                config.data_dir.display()
            )
        })?;
        let tls = tls::Tls::start(&config.tls, &config.data_dir)?.map(Arc::new);
        // The leader's certificate comes from the cluster CA every server
        // shares (the data directory's tls/ca.pem), or the system's roots.
        let trust = muster_api::tls::Trust {
            ca_pem: std::fs::read(config.data_dir.join("tls/ca.pem")).ok(),
            ca_sha256: None,
        };
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            // Long polls and log follows wait up to a minute.
            .timeout(Duration::from_secs(90))
            .redirect(reqwest::redirect::Policy::none());
        builder = match muster_api::tls::client_config(&trust).map_err(anyhow::Error::msg)? {
            Some(client) => builder.tls_backend_preconfigured(client),
            None => builder,
        };
        let http = builder
            .build()
            .context("cannot set up the forwarding client")?;
        let router = axum::Router::new()
            .fallback(forward)
            .with_state(Arc::new(Forwarding { leader, http }));
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let (shutdown, receiver) = watch::channel(false);
        let mut stop = receiver.clone();
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let mut tasks = Vec::new();
        match &tls {
            None => tasks.push(tokio::spawn(crate::serve(listener, router, stopped))),
            Some(tls) => {
                tasks.push(tokio::spawn(tls.clone().watch(receiver.clone())));
                let listener = tls.listener(listener, receiver)?;
                tasks.push(tokio::spawn(crate::serve(listener, router, stopped)));
            }
        }
        Ok(Forwarder { shutdown, tasks })
    }

    /// Stops serving at once (requests in flight are dropped: their
    /// clients retry); the address is free when this returns.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}
