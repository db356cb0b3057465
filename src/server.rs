//! The accept loop shared by the client and admin listeners: hyper 1 over HTTP/1.1 and
//! HTTP/2 (negotiated per connection), with graceful shutdown driven by a watch channel.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::body::{self, Body};

/// Serves `listener` until `shutdown` flips, then waits up to `grace` for the requests in
/// flight to finish. Returns whether they all finished in time.
pub(crate) async fn serve<F, Fut>(
    listener: TcpListener,
    handler: F,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> bool
where
    F: Fn(Request<Body>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Running out of file descriptors is transient; do not spin on it.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let service = service_fn(move |request: Request<Incoming>| {
                    let handler = handler.clone();
                    async move { Ok::<_, std::convert::Infallible>(handler(request.map(body::boxed)).await) }
                });
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => true,
        _ = tokio::time::sleep(grace) => {
            warn!(?grace, "shutdown grace period over; closing the connections still open");
            false
        }
    }
}

/// Binds a listener, naming the address when it cannot.
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, crate::StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| crate::StartError::Bind { addr, source })
}
