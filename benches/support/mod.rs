//! What the benches share: a local provider that answers at once, so the figures measure
//! the gateway and not the provider.

// Each bench uses a part of this module.
#![allow(dead_code)]

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub(crate) const ANSWER: &[u8] = include_bytes!("../../tests/fixtures/openai-chat-completion.json");
pub(crate) const REQUEST: &[u8] = include_bytes!("../../tests/fixtures/openai-chat-request.json");

/// Starts a provider answering every request with the completion fixture; its base URL.
pub(crate) async fn provider() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let _ = stream.set_nodelay(true);
            let service = service_fn(|request: Request<Incoming>| async move {
                let _ = request.into_body().collect().await;
                let mut response = hyper::Response::new(Full::new(Bytes::from_static(ANSWER)));
                response
                    .headers_mut()
                    .insert("content-type", "application/json".parse().unwrap());
                Ok::<_, std::convert::Infallible>(response)
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// The runtime every bench runs on: two workers, as on the machines it is measured on.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A gateway config with one route `chat` on `/v1` over one provider at `upstream`, on
/// `store` (a `[store]` table, or "" for the default).
pub(crate) fn config(upstream: &str, store: &str) -> idemgate::Config {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n{store}\n\
         [[providers]]\nname = \"p\"\nbase_url = \"{upstream}\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"p\"]\n"
    );
    idemgate::Config::parse(&text, "bench").unwrap()
}
