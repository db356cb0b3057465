//! A provider that answers every request at once with the OpenAI completion fixture: the
//! far end of `benches/overhead.sh`, so the figures measure the proxy and not the provider.
//!
//!     cargo run --release --example mock_provider -- 127.0.0.1:9000
//!
//! `ANSWER_BYTES=2048` pads the answer with trailing whitespace (still the same JSON) to
//! that size, for measuring what a stored job of a given size costs.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const ANSWER: &[u8] = include_bytes!("../tests/fixtures/openai-chat-completion.json");

fn main() {
    let answer = match std::env::var("ANSWER_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(size) if size > ANSWER.len() => {
            let mut padded = ANSWER.to_vec();
            padded.resize(size, b' ');
            Bytes::from(padded)
        }
        _ => Bytes::from_static(ANSWER),
    };
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let listener = TcpListener::bind(&addr).await.expect("bind");
        println!("{}", listener.local_addr().expect("address"));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let answer = answer.clone();
                    async move {
                        let _ = request.into_body().collect().await;
                        let mut response = hyper::Response::new(Full::new(answer));
                        response.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}
