//! The accept loops of the client and admin listeners: hyper 1 over HTTP/1.1 and HTTP/2
//! (negotiated per connection), each connection watched by the edge's timers, graceful
//! shutdown driven by a watch channel.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

use crate::body::{self, Body};
use crate::edge::conn::{ConnState, Finished, Watched};

/// What a listener serves each request with.
pub(crate) type Service = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// A response on its way, boxed so the connection's type names no service internals.
type Responding =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>>;

/// How a listener treats its connections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections open at once; beyond it new ones wait in the listen backlog.
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Serves `listener` with `service` until `shutdown` flips, then waits up to `grace` for the
/// requests in flight to finish. Returns whether they all finished in time.
pub(crate) async fn serve(
    listener: TcpListener,
    service: Service,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> bool {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The edge's own timers (conn.rs) replace hyper's, which would close a slow head
    // without the 408 the spec asks for.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(crate::edge::conn::MAX_HEAD_BYTES);
    builder
        .http2()
        .max_header_list_size(crate::edge::conn::MAX_HEAD_BYTES as u32);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        // A slot first, then accept: past max_connections, clients wait in the backlog
        // instead of being accepted and dropped.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Running out of file descriptors is transient; do not spin on it.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let state = ConnState::new(limits.header_timeout, limits.idle_timeout);
        let io = TokioIo::new(Watched::new(stream, state.clone()));
        let service = {
            let state = state.clone();
            let service = service.clone();
            service_fn(move |request: Request<Incoming>| -> Responding {
                state.request_started(request.version() == Version::HTTP_2);
                let finished = Finished(state.clone());
                Box::pin(respond(service.clone(), request.map(body::boxed), finished))
            })
        };
        let connection = builder.serve_connection(io, service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _slot = slot;
            tokio::pin!(connection);
            tokio::select! {
                ended = &mut connection => {
                    if let Err(e) = ended {
                        debug!(%peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = state.expired() => debug!(%peer, "connection closed by its timers"),
            }
            // The connection sees its failed read at once; bound it all the same.
            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
        });
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

/// Serves one request; the request counts as in flight until its response body is done
/// with (written whole, or dropped).
async fn respond(
    mut service: Service,
    request: Request<Body>,
    finished: Finished,
) -> Result<Response<Body>, Infallible> {
    std::future::poll_fn(|cx| tower::Service::poll_ready(&mut service, cx)).await?;
    let response = tower::Service::call(&mut service, request).await?;
    Ok(response.map(move |body| {
        body.map_err(move |e| {
            let _done = &finished;
            e
        })
        .boxed_unsync()
    }))
}

/// Binds a listener, naming the address when it cannot. The backlog is large (the kernel
/// caps it at `somaxconn`): past `max_connections`, clients wait there, and a burst of
/// connections must not be reset by a short queue.
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, crate::StartError> {
    let fail = |source| crate::StartError::Bind { addr, source };
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(fail)?;
    socket.set_reuseaddr(true).map_err(fail)?;
    socket.bind(addr).map_err(fail)?;
    socket.listen(4096).map_err(fail)
}
