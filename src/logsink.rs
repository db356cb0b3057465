//! Where log lines go: stderr, in one `write(2)` per line while the gateway is idle and in
//! batches while it is busy (the default), or with `[log] buffered = false` in one `write(2)`
//! per line always.
//!
//! Every request writes an access line (SPEC §11), and written on its own that system call
//! is about a tenth of a replay's CPU. Batched, a runtime worker thread writes the first line
//! after it last slept at once, and keeps the lines that follow in a buffer of its own until
//! it runs out of work (the runtime calls [`flush_before_park`] just before the thread
//! sleeps), the buffer passes [`FLUSH_AT`], or the thread ends. A request that finds the
//! gateway idle — one client, or a test sending one request at a time — therefore has its
//! line written before its answer, as unbuffered; under load a line waits only while its
//! thread is busy with other requests, and a `kill -9` can lose the lines of that moment, as
//! with nginx's `access_log … buffer=`. A line is never held while the gateway idles.
//!
//! Any other thread (the main thread before the runtime, a store's writer thread, a test)
//! writes each line at once: only a thread that parks in a runtime whose park hook is
//! [`flush_before_park`] ever batches.

use std::cell::RefCell;
use std::io::{self, Write};
use std::sync::Arc;

use tracing_subscriber::fmt::MakeWriter;

/// A worker's buffer is written once it holds this much, busy or not.
pub const FLUSH_AT: usize = 32 * 1024;

/// Where batches are written.
pub trait Sink: Send + Sync {
    /// Writes whole lines; a failure to log is not the request's failure, so it is dropped.
    fn write_lines(&self, lines: &[u8]);
}

struct Stderr;

impl Sink for Stderr {
    fn write_lines(&self, lines: &[u8]) {
        // Locked, so that another thread's batch cannot land in the middle of this one.
        let _ = io::stderr().lock().write_all(lines);
    }
}

/// The [`MakeWriter`] of the gateway's log.
#[derive(Clone)]
pub struct Batched {
    sink: Arc<dyn Sink>,
}

impl Batched {
    pub fn stderr() -> Self {
        Self::new(Arc::new(Stderr))
    }

    pub fn new(sink: Arc<dyn Sink>) -> Self {
        Self { sink }
    }
}

impl std::fmt::Debug for Batched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched").finish_non_exhaustive()
    }
}

impl<'a> MakeWriter<'a> for Batched {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line { sink: &self.sink }
    }
}

/// One event's writer. The formatter hands it the whole line in one `write_all`.
pub struct Line<'a> {
    sink: &'a Arc<dyn Sink>,
}

impl std::fmt::Debug for Line<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Line").finish_non_exhaustive()
    }
}

impl Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let kept = PENDING
            .try_with(|pending| {
                let mut pending = pending.borrow_mut();
                if !pending.batching {
                    return false;
                }
                if !pending.busy {
                    // The first line since the thread last slept: it may be the only one
                    // before the next sleep, and goes out before its answer.
                    pending.busy = true;
                    return false;
                }
                let same = (pending.sink.as_ref()).is_some_and(|sink| Arc::ptr_eq(sink, self.sink));
                if !same {
                    // Another sink's lines first, in their order.
                    pending.write_out();
                    pending.sink = Some(self.sink.clone());
                }
                pending.bytes.extend_from_slice(bytes);
                if pending.bytes.len() >= FLUSH_AT {
                    pending.write_out();
                }
                true
            })
            // The thread is ending and its buffer is gone: straight out.
            .unwrap_or(false);
        if !kept {
            self.sink.write_lines(bytes);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Pending {
    /// Set the first time the thread parks in a runtime: only such a thread is sure to
    /// come back to [`flush_before_park`].
    batching: bool,
    /// A line was logged since the thread last parked: the lines after it are held.
    busy: bool,
    bytes: Vec<u8>,
    sink: Option<Arc<dyn Sink>>,
}

impl Pending {
    fn write_out(&mut self) {
        if let Some(sink) = &self.sink {
            if !self.bytes.is_empty() {
                sink.write_lines(&self.bytes);
            }
        }
        self.bytes.clear();
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.write_out();
    }
}

thread_local! {
    static PENDING: RefCell<Pending> = const {
        RefCell::new(Pending {
            batching: false,
            busy: false,
            bytes: Vec::new(),
            sink: None,
        })
    };
}

/// The runtime's `on_thread_park` hook: writes what this thread holds, and from now on lets
/// it batch.
pub fn flush_before_park() {
    let _ = PENDING.try_with(|pending| {
        let mut pending = pending.borrow_mut();
        pending.batching = true;
        pending.busy = false;
        pending.write_out();
    });
}

/// Writes what this thread holds, as its runtime stops: the main thread of a one-core
/// gateway is its worker, and a process's main thread may end without running the
/// destructors of its thread-local values.
pub fn flush_thread() {
    let _ = PENDING.try_with(|pending| pending.borrow_mut().write_out());
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// Each write the sink receives, as one message.
    struct Channel(Mutex<mpsc::Sender<Vec<u8>>>);

    impl Sink for Channel {
        fn write_lines(&self, lines: &[u8]) {
            let _ = self.0.lock().unwrap().send(lines.to_vec());
        }
    }

    fn channel() -> (Batched, mpsc::Receiver<Vec<u8>>) {
        let (tx, rx) = mpsc::channel();
        (Batched::new(Arc::new(Channel(Mutex::new(tx)))), rx)
    }

    fn log(writer: &Batched, line: &str) {
        writer.make_writer().write_all(line.as_bytes()).unwrap();
    }

    const BOUND: Duration = Duration::from_secs(10);

    #[test]
    fn a_thread_that_never_parked_writes_each_line_at_once() {
        let (writer, written) = channel();
        std::thread::spawn(move || {
            log(&writer, "one\n");
            assert_eq!(written.try_recv().unwrap(), b"one\n");
            log(&writer, "two\n");
            assert_eq!(written.try_recv().unwrap(), b"two\n");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_worker_writes_its_first_line_at_once_and_the_rest_when_it_runs_out_of_work() {
        let (writer, written) = channel();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .on_thread_park(flush_before_park)
            .build()
            .unwrap();
        let written = runtime.block_on(async move {
            tokio::spawn(async move {
                // As if the worker had parked before: the task runs on a batching thread.
                flush_before_park();
                log(&writer, "first\n");
                assert_eq!(written.try_recv().unwrap(), b"first\n");
                log(&writer, "second\n");
                log(&writer, "third\n");
                // Still working: the lines after the first wait.
                written.try_recv().unwrap_err();
                written
            })
            .await
            .unwrap()
        });
        // The task is done and the worker has nothing else to do: it parks and writes.
        assert_eq!(written.recv_timeout(BOUND).unwrap(), b"second\nthird\n");
    }

    #[test]
    fn a_thread_that_sleeps_between_lines_writes_each_at_once() {
        let (writer, written) = channel();
        std::thread::spawn(move || {
            for line in ["one\n", "two\n", "three\n"] {
                flush_before_park();
                log(&writer, line);
                assert_eq!(written.try_recv().unwrap(), line.as_bytes());
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_full_buffer_is_written_without_waiting_for_a_park() {
        let (writer, written) = channel();
        std::thread::spawn(move || {
            flush_before_park();
            log(&writer, "first\n");
            assert_eq!(written.try_recv().unwrap(), b"first\n");
            let line = format!("{}\n", "x".repeat(1023));
            for _ in 0..FLUSH_AT / line.len() - 1 {
                log(&writer, &line);
            }
            written.try_recv().unwrap_err();
            log(&writer, &line);
            assert_eq!(written.try_recv().unwrap().len(), FLUSH_AT);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_park_or_a_stop_writes_what_the_thread_holds_and_a_thread_that_ends_writes_the_rest() {
        let (writer, written) = channel();
        let (other, other_written) = channel();
        std::thread::spawn(move || {
            flush_before_park();
            log(&writer, "a\n");
            assert_eq!(written.try_recv().unwrap(), b"a\n");
            log(&writer, "b\n");
            written.try_recv().unwrap_err();
            flush_before_park();
            assert_eq!(written.try_recv().unwrap(), b"b\n");
            log(&writer, "c\n");
            log(&writer, "d\n");
            written.try_recv().unwrap();
            flush_thread();
            assert_eq!(written.try_recv().unwrap(), b"d\n");
            log(&writer, "e\n");
            // Another sink's line: what the first holds goes out first, in its order.
            log(&other, "f\n");
            assert_eq!(written.try_recv().unwrap(), b"e\n");
            log(&other, "g\n");
            (written, other_written)
        })
        .join()
        .map(|(_, other_written)| {
            assert_eq!(other_written.recv_timeout(BOUND).unwrap(), b"f\ng\n");
        })
        .unwrap();
    }
}
