//! The storage redb writes through: a redo journal in front of the database file, so that a
//! durable commit costs the disk one sequential write and one flush.
//!
//! redb commits copy-on-write: a commit's pages land wherever its allocator finds room, and
//! on a virtual disk a sync of a dozen scattered pages costs about a dozen times one
//! (README "Stores" has the figures). So nothing redb writes reaches the database file
//! directly. Between two syncs its writes (and its resizes) are only appended, in order, to
//! an in-memory record; its sync writes that record to the journal in one `pwrite` behind
//! a checksummed head, flushes the journal, and only then applies the record to the
//! database file, where the kernel writes the pages back in its own time. Reads see the
//! file patched by the record not yet synced.
//!
//! The journal is two files, `<db>-journal.0` and `<db>-journal.1`, each with a header that
//! names its generation; a record carries the generation of the file it was written to, so
//! what an older generation left in a reused file is never read. Once the active file has
//! grown past [`LIMIT`], the next sync moves to the other file and a background thread
//! syncs the database file; until it has, the first file's records stay valid, and the
//! other file is not reused. So the valid records of the two files, in generation order, are
//! always every commit since the database file was last synced, and opening replays them
//! over it: the database file plus the journal is the last synced commit, and nothing that
//! was not synced. A record torn by a crash fails its checksum and ends the replay; its
//! commit was never acknowledged.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use xxhash_rust::xxh3::xxh3_64;

/// Journal bytes written to one file before the next sync moves to the other.
const LIMIT: u64 = 64 << 20;
/// A journal file's header: magic, generation, the hash of both.
const MAGIC: &[u8; 8] = b"idgjrnl1";
const HEADER_LEN: usize = 24;
/// Records start on the second page, so that no record's write shares the header's.
const RECORDS_AT: u64 = 4096;
/// A record's head: magic, body length, generation, hash of the body, hash of the head.
const RECORD_MAGIC: &[u8; 8] = b"idgrcrd1";
const HEAD_LEN: usize = 40;
const OP_WRITE: u8 = 1;
const OP_SET_LEN: u8 = 2;

/// The database file and its journal, as redb's [`redb::StorageBackend`].
#[derive(Debug)]
pub(super) struct Journaled {
    main: Arc<File>,
    inner: Mutex<Inner>,
    checkpoint: Checkpointer,
}

#[derive(Debug)]
struct Inner {
    journals: [File; 2],
    active: usize,
    /// Of the active journal file.
    generation: u64,
    /// Where the active file's next record goes.
    end: u64,
    /// [`HEAD_LEN`] bytes of room for the head, then the writes since the last sync.
    pending: Vec<u8>,
    /// The length redb sees: the database file's after the pending writes.
    len: u64,
    /// The database file's own length.
    main_len: u64,
    limit: u64,
    /// A write whose outcome is not known: nothing more is written until a reopen replays.
    broken: bool,
}

/// Syncs the database file off the writer's thread, after a switch of journal files.
#[derive(Debug)]
struct Checkpointer {
    /// A sync of the database file has been asked for and has not finished.
    busy: Arc<AtomicBool>,
    /// Set when one failed: the retired journal file must then never be reused.
    failed: Arc<AtomicBool>,
    requests: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Why a file could not be opened as the database with its journal.
#[derive(Debug, thiserror::Error)]
pub(super) enum OpenError {
    #[error("it is open in another process")]
    Locked,
    #[error("{0} is not a journal of this store; move it away to start without it")]
    ForeignJournal(PathBuf),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// One operation of a record.
#[derive(Debug, PartialEq, Eq)]
enum Op<'a> {
    Write(u64, &'a [u8]),
    SetLen(u64),
}

pub(super) fn journal_paths(main: &Path) -> [PathBuf; 2] {
    let name = main.file_name().unwrap_or_default().to_string_lossy();
    [0, 1].map(|n| main.with_file_name(format!("{name}-journal.{n}")))
}

impl Journaled {
    /// Opens the database file at `path` (creating it when missing) and its journal, and
    /// replays every valid record over the file. Returns the storage and how many records it
    /// replayed.
    pub(super) fn open(path: &Path) -> Result<(Self, usize), OpenError> {
        Self::open_with_limit(path, LIMIT)
    }

    fn open_with_limit(path: &Path, limit: u64) -> Result<(Self, usize), OpenError> {
        let existed = path.exists();
        let main = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        main.try_lock().map_err(|e| match e {
            std::fs::TryLockError::WouldBlock => OpenError::Locked,
            std::fs::TryLockError::Error(e) => OpenError::Io(e),
        })?;
        let paths = journal_paths(path);
        let mut created = false;
        let mut journals = Vec::with_capacity(2);
        let mut generations = [None, None];
        for (n, journal_path) in paths.iter().enumerate() {
            created |= !journal_path.exists();
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(journal_path)?;
            if file.metadata()?.len() > 0 {
                generations[n] = Some(
                    read_header(&file)?
                        .ok_or_else(|| OpenError::ForeignJournal(journal_path.clone()))?,
                );
            }
            journals.push(file);
        }
        let journals: [File; 2] = journals.try_into().expect("two journal files");
        if created {
            sync_directory(path)?;
        }

        // A database file made just now has no history: whatever journal lies beside it
        // belonged to a file that is gone.
        let mut replayed = 0;
        let mut order: Vec<usize> = (0..2).filter(|&n| generations[n].is_some()).collect();
        order.sort_by_key(|&n| generations[n]);
        if existed {
            for &n in &order {
                let generation = generations[n].expect("a valid header");
                replayed += replay(&journals[n], generation, &main)?;
            }
            if replayed > 0 {
                main.sync_data()?;
            }
        }

        // Start both files afresh, above every generation either has held: neither holds a
        // valid record now, and the database file holds all they did.
        let top = generations.iter().flatten().max().copied().unwrap_or(0);
        write_header(&journals[1], top + 1)?;
        write_header(&journals[0], top + 2)?;
        for journal in &journals {
            journal.sync_data()?;
        }

        let main = Arc::new(main);
        let main_len = main.metadata()?.len();
        let checkpoint = Checkpointer::start(main.clone())?;
        let inner = Inner {
            journals,
            active: 0,
            generation: top + 2,
            end: RECORDS_AT,
            pending: vec![0; HEAD_LEN],
            len: main_len,
            main_len,
            limit,
            broken: false,
        };
        let journaled = Self {
            main,
            inner: Mutex::new(inner),
            checkpoint,
        };
        Ok((journaled, replayed))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while the lock was held left `broken` as it was: writes check it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For tests: ends as a crash would, with no sync of the database file and no reset of
    /// the journal.
    #[cfg(test)]
    fn crash(mut self) {
        self.checkpoint.stop();
        let mut inner = self.lock();
        inner.broken = true;
    }
}

impl Inner {
    fn pending_ops(&self) -> impl Iterator<Item = io::Result<Op<'_>>> {
        ops(&self.pending[HEAD_LEN..])
    }

    fn is_clean(&self) -> bool {
        self.pending.len() == HEAD_LEN
    }

    fn check(&self) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::other(
                "an earlier write to the store's file failed; reopen it to recover",
            ));
        }
        Ok(())
    }
}

impl redb::StorageBackend for Journaled {
    fn len(&self) -> io::Result<u64> {
        Ok(self.lock().len)
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let inner = self.lock();
        let end = offset
            .checked_add(len as u64)
            .filter(|&end| end <= inner.len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        let mut buffer = vec![0; len];
        // What the database file has of the range; a pending resize may have grown past it.
        let from_file = inner.main_len.min(end).saturating_sub(offset) as usize;
        if inner.is_clean() {
            drop(inner);
            self.main.read_exact_at(&mut buffer[..from_file], offset)?;
            return Ok(buffer);
        }
        self.main.read_exact_at(&mut buffer[..from_file], offset)?;
        for op in inner.pending_ops() {
            patch(&mut buffer, offset, op?);
        }
        Ok(buffer)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut inner = self.lock();
        inner.check()?;
        inner.pending.push(OP_SET_LEN);
        inner.pending.extend_from_slice(&len.to_le_bytes());
        inner.len = len;
        Ok(())
    }

    fn sync_data(&self, _eventual: bool) -> io::Result<()> {
        let mut inner = self.lock();
        inner.check()?;
        if let Some(e) = self.checkpoint.failure() {
            inner.broken = true;
            return Err(e);
        }
        if inner.is_clean() {
            return Ok(());
        }
        // Until the outcome is known, nothing else may be written: a record half applied to
        // the database file is whole only in the journal.
        inner.broken = true;
        let body_len = (inner.pending.len() - HEAD_LEN) as u64;
        let head = record_head(body_len, inner.generation, &inner.pending[HEAD_LEN..]);
        inner.pending[..HEAD_LEN].copy_from_slice(&head);
        let journal = &inner.journals[inner.active];
        journal.write_all_at(&inner.pending, inner.end)?;
        journal.sync_data()?;
        inner.end += inner.pending.len() as u64;
        for op in inner.pending_ops() {
            apply(&self.main, op?)?;
        }
        inner.main_len = self.main.metadata()?.len();
        inner.pending.truncate(HEAD_LEN);
        if inner.end >= inner.limit && self.checkpoint.idle() {
            let next = 1 - inner.active;
            let generation = inner.generation + 1;
            write_header(&inner.journals[next], generation)?;
            inner.journals[next].sync_data()?;
            inner.active = next;
            inner.generation = generation;
            inner.end = RECORDS_AT;
            self.checkpoint.request();
        }
        inner.broken = false;
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut inner = self.lock();
        inner.check()?;
        let len = u32::try_from(data.len())
            .map_err(|_| io::Error::other("a write of 4 GiB or more in one piece"))?;
        inner.pending.push(OP_WRITE);
        inner.pending.extend_from_slice(&offset.to_le_bytes());
        inner.pending.extend_from_slice(&len.to_le_bytes());
        inner.pending.extend_from_slice(data);
        inner.len = inner.len.max(offset + u64::from(len));
        Ok(())
    }
}

impl Drop for Journaled {
    /// A clean stop leaves the database file whole and the journal empty, so a file copied
    /// while the gateway is stopped needs nothing beside it.
    fn drop(&mut self) {
        self.checkpoint.stop();
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        if inner.broken || self.checkpoint.failure().is_some() {
            return;
        }
        let emptied = self.main.sync_data().and_then(|()| {
            let generation = inner.generation + 1;
            write_header(&inner.journals[1 - inner.active], generation)?;
            write_header(&inner.journals[inner.active], generation + 1)?;
            inner.journals.iter().try_for_each(File::sync_data)
        });
        if let Err(e) = emptied {
            tracing::warn!(error = %e, "embedded store: the journal is replayed at the next start");
        }
    }
}

impl Checkpointer {
    fn start(main: Arc<File>) -> io::Result<Self> {
        let busy = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicBool::new(false));
        let (requests, asked) = mpsc::channel::<()>();
        let thread = {
            let (busy, failed) = (busy.clone(), failed.clone());
            std::thread::Builder::new()
                .name("idemgate-checkpoint".into())
                .spawn(move || {
                    while asked.recv().is_ok() {
                        if let Err(e) = main.sync_data() {
                            tracing::error!(error = %e, "embedded store: syncing the database file failed");
                            failed.store(true, Ordering::Release);
                        }
                        busy.store(false, Ordering::Release);
                    }
                })?
        };
        Ok(Self {
            busy,
            failed,
            requests: Some(requests),
            thread: Some(thread),
        })
    }

    fn idle(&self) -> bool {
        !self.busy.load(Ordering::Acquire)
    }

    fn request(&self) {
        self.busy.store(true, Ordering::Release);
        if let Some(requests) = &self.requests {
            let _ = requests.send(());
        }
    }

    fn failure(&self) -> Option<io::Error> {
        self.failed
            .load(Ordering::Acquire)
            .then(|| io::Error::other("syncing the store's file failed"))
    }

    /// Waits for a sync in flight, then ends the thread.
    fn stop(&mut self) {
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn record_head(body_len: u64, generation: u64, body: &[u8]) -> [u8; HEAD_LEN] {
    let mut head = [0; HEAD_LEN];
    head[..8].copy_from_slice(RECORD_MAGIC);
    head[8..16].copy_from_slice(&body_len.to_le_bytes());
    head[16..24].copy_from_slice(&generation.to_le_bytes());
    head[24..32].copy_from_slice(&xxh3_64(body).to_le_bytes());
    let sealed = xxh3_64(&head[..32]);
    head[32..].copy_from_slice(&sealed.to_le_bytes());
    head
}

fn write_header(journal: &File, generation: u64) -> io::Result<()> {
    let mut header = [0; HEADER_LEN];
    header[..8].copy_from_slice(MAGIC);
    header[8..16].copy_from_slice(&generation.to_le_bytes());
    let sealed = xxh3_64(&header[..16]);
    header[16..].copy_from_slice(&sealed.to_le_bytes());
    journal.write_all_at(&header, 0)
}

/// The generation a journal file's header names; `None` when it is not such a header.
fn read_header(journal: &File) -> io::Result<Option<u64>> {
    let mut header = [0; HEADER_LEN];
    match journal.read_exact_at(&mut header, 0) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let sealed = u64::from_le_bytes(header[16..].try_into().expect("8 bytes"));
    if &header[..8] != MAGIC || xxh3_64(&header[..16]) != sealed {
        return Ok(None);
    }
    Ok(Some(u64::from_le_bytes(
        header[8..16].try_into().expect("8 bytes"),
    )))
}

/// Applies the valid records of `generation` in `journal`, in order, to `main`; returns how
/// many. The first record that is missing, torn or of another generation ends them.
fn replay(journal: &File, generation: u64, main: &File) -> io::Result<usize> {
    let size = journal.metadata()?.len();
    let mut at = RECORDS_AT;
    let mut count = 0;
    while at + HEAD_LEN as u64 <= size {
        let mut head = [0; HEAD_LEN];
        journal.read_exact_at(&mut head, at)?;
        let word = |range: std::ops::Range<usize>| {
            u64::from_le_bytes(head[range].try_into().expect("8 bytes"))
        };
        let whole = &head[..8] == RECORD_MAGIC
            && xxh3_64(&head[..32]) == word(32..40)
            && word(16..24) == generation;
        let body_len = word(8..16);
        if !whole || body_len > size - at - HEAD_LEN as u64 {
            break;
        }
        let mut body = vec![0; body_len as usize];
        journal.read_exact_at(&mut body, at + HEAD_LEN as u64)?;
        if xxh3_64(&body) != word(24..32) {
            break;
        }
        for op in ops(&body) {
            apply(main, op?)?;
        }
        count += 1;
        at += HEAD_LEN as u64 + body_len;
    }
    Ok(count)
}

fn apply(main: &File, op: Op<'_>) -> io::Result<()> {
    match op {
        Op::Write(offset, data) => main.write_all_at(data, offset),
        Op::SetLen(len) => main.set_len(len),
    }
}

/// Lays `op` over `buffer`, which holds the bytes from `offset`.
fn patch(buffer: &mut [u8], offset: u64, op: Op<'_>) {
    let end = offset + buffer.len() as u64;
    match op {
        Op::Write(at, data) => {
            let from = at.max(offset);
            let to = (at + data.len() as u64).min(end);
            if from < to {
                buffer[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&data[(from - at) as usize..(to - at) as usize]);
            }
        }
        // Bytes cut off by a shrink read as zero if a later growth brings them back.
        Op::SetLen(len) if len < end => buffer[(len.max(offset) - offset) as usize..].fill(0),
        Op::SetLen(_) => {}
    }
}

fn ops(mut body: &[u8]) -> impl Iterator<Item = io::Result<Op<'_>>> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "a malformed journal record");
    std::iter::from_fn(move || {
        let (&tag, rest) = body.split_first()?;
        fn take(rest: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
            (rest.len() >= n).then(|| rest.split_at(n))
        }
        let op = match tag {
            OP_SET_LEN => take(rest, 8).map(|(len, rest)| {
                body = rest;
                Op::SetLen(u64::from_le_bytes(len.try_into().expect("8 bytes")))
            }),
            OP_WRITE => take(rest, 12).and_then(|(fixed, rest)| {
                let offset = u64::from_le_bytes(fixed[..8].try_into().expect("8 bytes"));
                let len = u32::from_le_bytes(fixed[8..].try_into().expect("4 bytes")) as usize;
                take(rest, len).map(|(data, rest)| {
                    body = rest;
                    Op::Write(offset, data)
                })
            }),
            _ => None,
        };
        Some(op.ok_or_else(|| {
            body = &[];
            malformed()
        }))
    })
}

/// Makes the journal files' names durable: a record synced into a file whose directory
/// entry a crash loses is lost with it.
fn sync_directory(path: &Path) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}
