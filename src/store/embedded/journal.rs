//! The embedded store's write-ahead journal: what makes a claim or a settle durable.
//!
//! A group commit appends its changes to the active journal file as checksummed frames and
//! syncs it: one sequential write and one `fdatasync`, whatever the changes touch. The
//! tables in the database file are brought up to date later, many groups at a time, by the
//! checkpoint (see the module above); until then the journal is what survives a crash.
//!
//! There are two files beside the database, `<file>-journal.0` and `<file>-journal.1`. The
//! writer appends to one; a checkpoint moves it to the other, and once the tables hold
//! every change of the first, that one is reset and becomes the next to move to. A reset
//! file is not truncated but overwritten from its start: a sync that only overwrites blocks
//! the file already has commits no file-system metadata with it (an append grows the file,
//! and its sync has to record the new size as well).
//!
//! # Format
//!
//! A file starts with a header: `IDGJRNL1`, the first sequence number its frames may carry
//! (u64 LE), a CRC-32 of those 16 bytes (u32 LE), zero padding to [`HEADER_LEN`]. Frames
//! follow: payload length (u32 LE), CRC-32 of the sequence number and payload (u32 LE),
//! sequence number (u64 LE), payload. Sequence numbers rise across both files and are never
//! used twice, so reading stops at the first frame that is torn (its checksum fails), that
//! is left from before a reset (its number is below the header's) or that is left from a
//! failed write the next group overwrote (its number is not above the one before it).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"IDGJRNL1";
/// Where frames start: the header, padded to a size a device writes whole.
pub(super) const HEADER_LEN: u64 = 512;
/// Length, checksum, sequence number.
const FRAME_HEAD: usize = 16;
/// A frame claiming more than this is not one: it ends the journal. Records are bounded by
/// `max_stored_response_bytes` far below it.
const MAX_FRAME: u64 = 1 << 30;

/// Why a journal file cannot be used. Nothing is written to a file found so.
#[derive(Debug, thiserror::Error)]
pub(super) enum JournalError {
    #[error("journal {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("journal {path}: not a journal of this store, or its header is damaged")]
    Header { path: String },
}

/// One journal file.
#[derive(Debug)]
pub(super) struct Segment {
    file: Arc<File>,
    path: PathBuf,
}

impl Segment {
    fn io(&self, source: io::Error) -> JournalError {
        JournalError::Io {
            path: self.path.display().to_string(),
            source,
        }
    }

    /// Makes the file empty for frames from `start` on: its header is rewritten and synced,
    /// and every frame it held is left behind (their numbers are below `start`).
    pub(super) fn reset(&self, start: u64) -> Result<(), JournalError> {
        write_at(&self.file, &header(start), 0).map_err(|e| self.io(e))?;
        self.file.sync_data().map_err(|e| self.io(e))
    }
}

/// The writer's side of the journal: the two files, which one is active, where its next
/// frame goes, and the frames of the group being built.
#[derive(Debug)]
pub(super) struct Journal {
    segments: [Arc<Segment>; 2],
    active: usize,
    /// Where the active file's next frame is written.
    end: u64,
    /// The next frame's sequence number.
    next_seq: u64,
    /// Frames built and not yet written.
    pending: Vec<u8>,
}

/// What [`Journal::open`] found in the files: every frame that made it to disk, oldest
/// first, for the store to apply to its tables before it serves.
pub(super) type Recovered = Vec<(u64, Vec<u8>)>;

impl Journal {
    /// The journal files' paths beside the database file at `base`.
    pub(super) fn paths(base: &Path) -> [PathBuf; 2] {
        let name = base
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        [0, 1].map(|n| base.with_file_name(format!("{name}-journal.{n}")))
    }

    /// Opens the journal of the database at `base`, creating files that are missing, and
    /// reads every frame it holds. A file that exists but is not a journal is refused
    /// before anything is written to either.
    pub(super) fn open(base: &Path) -> Result<(Self, Recovered), JournalError> {
        let paths = Self::paths(base);
        let mut found = Vec::new();
        let mut start = 0;
        for path in &paths {
            match std::fs::read(path) {
                Ok(bytes) => {
                    let first = parse_header(&bytes).ok_or_else(|| JournalError::Header {
                        path: path.display().to_string(),
                    })?;
                    start = start.max(first);
                    found.extend(parse_frames(&bytes[HEADER_LEN as usize..], first));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(JournalError::Io {
                        path: path.display().to_string(),
                        source,
                    })
                }
            }
        }
        found.sort_unstable_by_key(|(seq, _)| *seq);
        let next_seq = found.last().map_or(start, |(seq, _)| seq + 1).max(start);
        let mut segments = Vec::with_capacity(2);
        for path in paths {
            let fresh = !path.exists();
            let segment = Segment {
                file: Arc::new(open_rw(&path)?),
                path,
            };
            if fresh {
                segment.reset(next_seq)?;
            }
            segments.push(Arc::new(segment));
        }
        let segments: [Arc<Segment>; 2] = segments.try_into().expect("two files");
        let journal = Self {
            segments,
            active: 0,
            end: HEADER_LEN,
            next_seq,
            pending: Vec::new(),
        };
        Ok((journal, found))
    }

    /// Makes both files empty once what they held is in the tables: the journal starts
    /// over in the first file.
    pub(super) fn reset_all(&mut self) -> Result<(), JournalError> {
        for segment in &self.segments {
            segment.reset(self.next_seq)?;
        }
        self.active = 0;
        self.end = HEADER_LEN;
        Ok(())
    }

    /// Adds a frame to the group being built, its payload written by `payload`; returns its
    /// sequence number.
    pub(super) fn frame(&mut self, payload: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let at = self.pending.len();
        self.pending.extend_from_slice(&[0; FRAME_HEAD]);
        self.pending[at + 8..at + 16].copy_from_slice(&seq.to_le_bytes());
        payload(&mut self.pending);
        let len = (self.pending.len() - at - FRAME_HEAD) as u32;
        let crc = crc32fast::hash(&self.pending[at + 8..]);
        self.pending[at..at + 4].copy_from_slice(&len.to_le_bytes());
        self.pending[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        seq
    }

    /// Writes the frames built since the last call and syncs them: once this returns `Ok`,
    /// they survive a crash. On an error nothing of the group counts: the next group is
    /// written where this one began, and the numbers it used are not used again, so what
    /// this one left behind is read as the end of the journal.
    pub(super) fn commit(&mut self) -> Result<(), JournalError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let segment = &self.segments[self.active];
        let written = write_at(&segment.file, &self.pending, self.end)
            .and_then(|()| segment.file.sync_data());
        let len = self.pending.len() as u64;
        self.pending.clear();
        written.map_err(|e| segment.io(e))?;
        self.end += len;
        Ok(())
    }

    /// Bytes of frames in the active file.
    pub(super) fn active_len(&self) -> u64 {
        self.end - HEADER_LEN
    }

    /// Moves the writer to the other file, which must have been reset since it was last
    /// active, and hands back the file it leaves with the sequence number to reset it to
    /// once the tables hold every frame it has.
    pub(super) fn rotate(&mut self) -> (Arc<Segment>, u64) {
        let retired = self.segments[self.active].clone();
        self.active = 1 - self.active;
        self.end = HEADER_LEN;
        (retired, self.next_seq)
    }
}

fn open_rw(path: &Path) -> Result<File, JournalError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| JournalError::Io {
            path: path.display().to_string(),
            source,
        })
}

fn header(start: u64) -> Vec<u8> {
    let mut bytes = vec![0; HEADER_LEN as usize];
    bytes[..8].copy_from_slice(MAGIC);
    bytes[8..16].copy_from_slice(&start.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..16]);
    bytes[16..20].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// The first sequence number of a file's frames, if `bytes` starts with a valid header.
fn parse_header(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < HEADER_LEN as usize || &bytes[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(bytes[16..20].try_into().ok()?);
    (crc32fast::hash(&bytes[..16]) == crc)
        .then(|| u64::from_le_bytes(bytes[8..16].try_into().unwrap()))
}

/// The valid frames at the start of `bytes`, a file's contents after its header.
fn parse_frames(mut bytes: &[u8], start: u64) -> Vec<(u64, Vec<u8>)> {
    let mut frames = Vec::new();
    let mut floor = start;
    while bytes.len() >= FRAME_HEAD {
        let len = u64::from(u32::from_le_bytes(bytes[..4].try_into().unwrap()));
        let crc = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
        let seq = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
        let Some(end) = usize::try_from(len)
            .ok()
            .filter(|_| len <= MAX_FRAME)
            .and_then(|len| FRAME_HEAD.checked_add(len))
            .filter(|end| *end <= bytes.len())
        else {
            break;
        };
        if seq < floor || crc32fast::hash(&bytes[8..end]) != crc {
            break;
        }
        frames.push((seq, bytes[FRAME_HEAD..end].to_vec()));
        floor = seq + 1;
        bytes = &bytes[end..];
    }
    frames
}

#[cfg(unix)]
fn write_at(file: &File, bytes: &[u8], at: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, bytes, at)
}

#[cfg(windows)]
fn write_at(file: &File, mut bytes: &[u8], mut at: u64) -> io::Result<()> {
    while !bytes.is_empty() {
        let n = std::os::windows::fs::FileExt::seek_write(file, bytes, at)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[n..];
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new journal beside `jobs.db` in a directory of its own.
    fn fresh() -> (tempfile::TempDir, std::path::PathBuf, Journal) {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("jobs.db");
        let (journal, found) = Journal::open(&base).unwrap();
        assert!(found.is_empty());
        (dir, base, journal)
    }

    fn payloads(recovered: &Recovered) -> Vec<(u64, &[u8])> {
        recovered.iter().map(|(s, p)| (*s, p.as_slice())).collect()
    }

    fn write(journal: &mut Journal, payloads: &[&[u8]]) -> Vec<u64> {
        let seqs = payloads
            .iter()
            .map(|p| journal.frame(|buf| buf.extend_from_slice(p)))
            .collect();
        journal.commit().unwrap();
        seqs
    }

    #[test]
    fn committed_frames_are_read_back_in_order_across_both_files() {
        let (_dir, base, mut journal) = fresh();
        assert_eq!(write(&mut journal, &[b"a", b"bb"]), [0, 1]);
        let (_retired, reset_to) = journal.rotate();
        assert_eq!(reset_to, 2);
        write(&mut journal, &[b"ccc"]);
        journal.frame(|buf| buf.extend_from_slice(b"never committed"));
        drop(journal);

        let (journal, found) = Journal::open(&base).unwrap();
        assert_eq!(
            payloads(&found),
            [(0, &b"a"[..]), (1, &b"bb"[..]), (2, &b"ccc"[..])]
        );
        assert_eq!(journal.next_seq, 3);
    }

    #[test]
    fn a_reset_file_forgets_its_frames_and_is_overwritten_from_its_start() {
        let (_dir, base, mut journal) = fresh();
        write(&mut journal, &[b"old one", b"old two", b"old three"]);
        let (retired, reset_to) = journal.rotate();
        write(&mut journal, &[b"kept"]);
        retired.reset(reset_to).unwrap();
        // Back to the first file: a shorter frame lands over the old ones, which stay
        // behind it on disk and must not be read.
        let (retired, reset_to) = journal.rotate();
        write(&mut journal, &[b"new"]);
        drop((retired, reset_to));
        let len = std::fs::metadata(&Journal::paths(&base)[0]).unwrap().len();
        assert!(
            len > HEADER_LEN + 40,
            "the old frames are still in the file"
        );

        let (_, found) = Journal::open(&base).unwrap();
        assert_eq!(payloads(&found), [(3, &b"kept"[..]), (4, &b"new"[..])]);
    }

    #[test]
    fn a_torn_or_damaged_tail_ends_the_journal_and_what_came_before_is_kept() {
        let (_dir, base, mut journal) = fresh();
        write(&mut journal, &[b"first", b"second"]);
        drop(journal);
        let path = &Journal::paths(&base)[0];
        let whole = std::fs::read(path).unwrap();
        let second = whole.len() - (FRAME_HEAD + b"second".len());

        // Cut inside the second frame, as a crash mid-write leaves it.
        std::fs::write(path, &whole[..whole.len() - 2]).unwrap();
        let (_, found) = Journal::open(&base).unwrap();
        assert_eq!(payloads(&found), [(0, &b"first"[..])]);

        // A flipped byte in the second frame's payload.
        let mut damaged = whole.clone();
        *damaged.last_mut().unwrap() ^= 1;
        std::fs::write(path, &damaged).unwrap();
        let (_, found) = Journal::open(&base).unwrap();
        assert_eq!(payloads(&found), [(0, &b"first"[..])]);

        // A length that runs past the end of the file.
        let mut damaged = whole.clone();
        damaged[second..second + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(path, &damaged).unwrap();
        let (_, found) = Journal::open(&base).unwrap();
        assert_eq!(payloads(&found), [(0, &b"first"[..])]);
    }

    #[test]
    fn a_failed_group_is_overwritten_and_its_leftovers_are_never_read() {
        let (_dir, base, mut journal) = fresh();
        write(&mut journal, &[b"kept"]);
        // A group that reached the file but whose commit reported an error: written by
        // hand at the journal's end, which the journal does not move past.
        let at = journal.end;
        let seqs: Vec<u64> = [&b"lost one, long enough"[..], b"lost two"]
            .iter()
            .map(|p| journal.frame(|buf| buf.extend_from_slice(p)))
            .collect();
        write_at(&journal.segments[0].file, &journal.pending, at).unwrap();
        journal.pending.clear();
        assert_eq!(seqs, [1, 2]);
        // The next group lands where the failed one began, with higher numbers.
        write(&mut journal, &[b"next"]);
        drop(journal);

        let (_, found) = Journal::open(&base).unwrap();
        assert_eq!(payloads(&found), [(0, &b"kept"[..]), (3, &b"next"[..])]);
    }

    #[test]
    fn a_file_that_is_not_a_journal_is_refused_and_left_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("jobs.db");
        let paths = Journal::paths(&base);
        std::fs::write(&paths[1], b"something else entirely").unwrap();
        let error = Journal::open(&base).unwrap_err().to_string();
        assert!(error.contains(&paths[1].display().to_string()), "{error}");
        assert_eq!(
            std::fs::read(&paths[1]).unwrap(),
            b"something else entirely"
        );
        assert!(!paths[0].exists(), "nothing is created either");
    }

    #[test]
    fn numbers_carry_on_after_a_reset_of_both_files() {
        let (_dir, base, mut journal) = fresh();
        write(&mut journal, &[b"a", b"b", b"c"]);
        journal.reset_all().unwrap();
        drop(journal);
        let (mut journal, found) = Journal::open(&base).unwrap();
        assert!(found.is_empty());
        assert_eq!(write(&mut journal, &[b"d"]), [3]);
    }
}
