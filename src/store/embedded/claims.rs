//! The claim index: which job holds each (owner, key), for every job the file holds, kept in
//! memory and rebuilt at open from the file's `claim_rows`.
//!
//! The file used to key the claims themselves, owner NUL key → job id, in a B-tree. Keys
//! that SDKs send are random UUIDs, so each new claim landed on a leaf of its own, and every
//! checkpoint copied, checksummed and wrote one leaf per job it took: filling one gateway
//! with UUID keys at 32 clients, the checkpointer's CPU per job grew from 34 to 57 µs
//! between 0.3 and 1.3 million jobs, where counted keys (which share the rightmost leaves)
//! cost 23–25 µs. Each claim was also a read transaction and a walk of that tree on the
//! writer thread. Now a lookup by (owner, key) is a hash lookup here, and the file needs no
//! claim index at all (filled the same way: 25–33 µs up to 1.9 million jobs): a job's id
//! carries the hash its claim is filed under, and the index is rebuilt at open from the
//! ids of the `expiry` index, which has one entry per job. `claim_rows` (row key → hash)
//! holds only the jobs whose ids do not carry their own hash, ids not minted from their
//! (owner, key): none in a gateway, some in tests of the store.
//!
//! Entries are keyed by the first 8 bytes of SHA-256(owner NUL key), the digest a minted job
//! id carries in its tag: a client cannot choose keys that collide, and the value is stable
//! across processes, so the file can hold it. Two identities may still share a prefix, so an
//! entry names candidates and the reader keeps the one whose job names the same (owner, key).

use std::collections::HashMap;

use redb::{ReadableTable, TableDefinition};

use crate::job::JobId;

/// A claim key (owner NUL key) with its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ClaimKey {
    pub(super) bytes: Vec<u8>,
    pub(super) hash: u64,
}

impl ClaimKey {
    pub(super) fn new(owner: &str, key: &str) -> Self {
        Self::with_identity(owner, key, &crate::job::claim_digest_bytes(owner, key))
    }

    /// As [`ClaimKey::new`], with the hash taken from `identity`, which is
    /// `job::claim_digest_bytes(owner, key)` already computed: the hash is its first 8 bytes.
    pub(super) fn with_identity(owner: &str, key: &str, identity: &[u8; 32]) -> Self {
        let mut bytes = Vec::with_capacity(owner.len() + 1 + key.len());
        bytes.extend_from_slice(owner.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(key.as_bytes());
        Self {
            bytes,
            hash: hash_in(identity),
        }
    }

    pub(super) fn of(record: &crate::job::JobRecord) -> Self {
        Self::new(&record.job.owner, &record.job.key)
    }

    /// Whether the job is the one of this (owner, key).
    pub(super) fn names(&self, record: &crate::job::JobRecord) -> bool {
        let (owner, key) = (record.job.owner.as_bytes(), record.job.key.as_bytes());
        self.bytes.len() == owner.len() + 1 + key.len()
            && self.bytes.starts_with(owner)
            && self.bytes[owner.len()] == 0
            && self.bytes.ends_with(key)
    }
}

/// A job filed under a hash: nearly always one whose id was minted from that very hash
/// (`job_`, the hash's 16 hex digits, 32 hex digits of time), held as the time's 16 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Holder {
    Minted([u8; 16]),
    Other(Box<str>),
}

impl Holder {
    pub(super) fn new(hash: u64, id: &str) -> Self {
        match minted_time(hash, id) {
            Some(time) => Self::Minted(time),
            None => Self::Other(id.into()),
        }
    }

    fn id(&self, hash: u64) -> JobId {
        match self {
            Self::Minted(time) => minted_id(hash, time),
            Self::Other(id) => id.to_string(),
        }
    }
}

/// The hash a minted id carries in its tag (lower-case hex, as minted), if it is one.
/// Whether it is the hash of the job's own (owner, key) is for its writer to check.
pub(super) fn carried_hash(id: &str) -> Option<u64> {
    let (tag, _) = crate::job::id_parts(id)?;
    lower_hex(tag, 16).then(|| u64::from_str_radix(tag, 16).ok())?
}

/// Whether `text` is `len` lower-case hex digits: what a minted id holds, and the only form
/// that gives the same string back when the digits are kept as bytes.
fn lower_hex(text: &str, len: usize) -> bool {
    text.len() == len
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The hash a claim is filed under: SHA-256(owner NUL key)'s first 8 bytes.
pub(super) fn hash_of(owner: &str, key: &str) -> u64 {
    hash_in(&crate::job::claim_digest_bytes(owner, key))
}

/// The hash a claim is filed under, out of its (owner, key)'s `claim_digest_bytes`.
fn hash_in(digest: &[u8; 32]) -> u64 {
    u64::from_be_bytes(digest[..8].try_into().expect("a digest has 8 bytes"))
}

/// One hash's jobs: one, or, should two identities share the hash, each of them. An entry
/// is 32 bytes, a job 38–75 bytes by the table's load: 69 MB for 1.9 million jobs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Holders {
    One(Holder),
    Several(Box<[Holder]>),
}

/// The time part of an id minted for `hash`, if `id` is one (exactly, so [`minted_id`]
/// gives the same string back).
fn minted_time(hash: u64, id: &str) -> Option<[u8; 16]> {
    let (_, time) = crate::job::id_parts(id)?;
    if carried_hash(id)? != hash || !lower_hex(time, 32) {
        return None;
    }
    let mut bytes = [0u8; 16];
    hex::decode_to_slice(time, &mut bytes).ok()?;
    Some(bytes)
}

fn minted_id(hash: u64, time: &[u8; 16]) -> JobId {
    // In place: `hex::encode` builds its string a `char` at a time.
    let mut id = [0u8; 4 + 16 + 32];
    id[..4].copy_from_slice(b"job_");
    hex::encode_to_slice(hash.to_be_bytes(), &mut id[4..20]).expect("16 digits");
    hex::encode_to_slice(time, &mut id[20..]).expect("32 digits");
    String::from_utf8(id.to_vec()).expect("hex is ASCII")
}

/// A change to the index that a checkpoint's transaction made in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Change {
    Add(u64, Holder),
    Remove(u64, Holder),
}

#[derive(Debug, Default)]
pub(super) struct ClaimIndex {
    holders: HashMap<u64, Holders, foldhash::fast::RandomState>,
    jobs: usize,
}

impl ClaimIndex {
    /// Every job the file holds: each has one entry in `expiry`, and its hash is the one
    /// its id carries unless `claim_rows` files it under another.
    pub(super) fn load(
        expiry: &impl ReadableTable<(u64, &'static str), ()>,
        claim_rows: &impl ReadableTable<&'static str, u64>,
    ) -> Result<Self, redb::StorageError> {
        let mut filed = HashMap::new();
        for row in claim_rows.iter()? {
            let (row, hash) = row?;
            filed.insert(super::id_of_row(row.value()), hash.value());
        }
        let mut index = Self::default();
        for entry in expiry.iter()? {
            let (entry, _) = entry?;
            let (_, id) = entry.value();
            let hash = filed.get(id).copied().or_else(|| carried_hash(id));
            if let Some(hash) = hash {
                index.add(hash, Holder::new(hash, id));
            }
        }
        Ok(index)
    }

    /// The jobs filed under `hash`, one of which may be the (owner, key) looked for.
    pub(super) fn candidates(&self, hash: u64) -> Vec<JobId> {
        match self.holders.get(&hash) {
            None => Vec::new(),
            Some(Holders::One(holder)) => vec![holder.id(hash)],
            Some(Holders::Several(holders)) => holders.iter().map(|h| h.id(hash)).collect(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.jobs
    }

    /// About what the index takes in memory: its table's slots, each with its control byte.
    pub(super) fn bytes(&self) -> usize {
        self.holders.capacity() * (std::mem::size_of::<(u64, Holders)>() + 1)
    }

    pub(super) fn apply(&mut self, change: Change) {
        match change {
            Change::Add(hash, holder) => self.add(hash, holder),
            Change::Remove(hash, holder) => self.remove(hash, &holder),
        }
    }

    /// Adding a job the index has already is nothing: a checkpoint whose commit failed is
    /// taken again whole.
    fn add(&mut self, hash: u64, holder: Holder) {
        use std::collections::hash_map::Entry;
        match self.holders.entry(hash) {
            Entry::Vacant(slot) => {
                slot.insert(Holders::One(holder));
            }
            Entry::Occupied(mut slot) => match slot.get_mut() {
                Holders::One(held) if *held == holder => return,
                Holders::One(held) => {
                    let held = held.clone();
                    slot.insert(Holders::Several(Box::new([held, holder])));
                }
                Holders::Several(held) if held.contains(&holder) => return,
                Holders::Several(held) => {
                    let mut more = held.to_vec();
                    more.push(holder);
                    *held = more.into_boxed_slice();
                }
            },
        }
        self.jobs += 1;
    }

    fn remove(&mut self, hash: u64, holder: &Holder) {
        use std::collections::hash_map::Entry;
        let Entry::Occupied(mut slot) = self.holders.entry(hash) else {
            return;
        };
        match slot.get_mut() {
            Holders::One(held) if held == holder => drop(slot.remove()),
            Holders::One(_) => return,
            Holders::Several(held) => {
                let Some(at) = held.iter().position(|h| h == holder) else {
                    return;
                };
                let mut left = held.to_vec();
                left.swap_remove(at);
                match <[Holder; 1]>::try_from(left) {
                    Ok([last]) => drop(slot.insert(Holders::One(last))),
                    Err(left) => *held = left.into_boxed_slice(),
                }
            }
        }
        self.jobs -= 1;
    }
}

/// `claim_rows`: a job's row key → the hash of its claim key.
pub(super) const CLAIM_ROWS: TableDefinition<&str, u64> = TableDefinition::new("claim_rows");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::new_job_id;

    #[test]
    fn a_minted_id_is_held_in_sixteen_bytes_and_given_back_whole() {
        let key = ClaimKey::new("owner", "key-1");
        let id = new_job_id("owner", "key-1");
        assert!(matches!(Holder::new(key.hash, &id), Holder::Minted(_)));
        let mut index = ClaimIndex::default();
        index.add(key.hash, Holder::new(key.hash, &id));
        assert_eq!(index.candidates(key.hash), vec![id.clone()]);
        assert_eq!(index.len(), 1);
        assert_eq!(std::mem::size_of::<(u64, Holders)>(), 32);
    }

    #[test]
    fn a_minted_id_carries_its_hash_and_no_other_id_does() {
        let key = ClaimKey::new("owner", "key-1");
        assert_eq!(carried_hash(&new_job_id("owner", "key-1")), Some(key.hash));
        let upper = format!(
            "job_{:016X}{}",
            key.hash | 0xa,
            "0123456789abcdef0123456789abcdef"
        );
        for id in ["job_1", "anything", "job_0123456789abcdeg", upper.as_str()] {
            assert_eq!(carried_hash(id), None, "{id}");
        }
    }

    #[test]
    fn ids_not_minted_for_the_hash_are_kept_as_they_are() {
        let key = ClaimKey::new("owner", "key-1");
        let other = new_job_id("owner", "key-2");
        for id in [
            other.as_str(),
            "job_1",
            "anything",
            &format!(
                "job_{:016x}{}",
                key.hash, "0123456789ABCDEF0123456789abcdef"
            ),
            &format!("job_{:016x}{}", key.hash, "short"),
        ] {
            assert!(
                matches!(Holder::new(key.hash, id), Holder::Other(_)),
                "{id}"
            );
            let mut index = ClaimIndex::default();
            index.add(key.hash, Holder::new(key.hash, id));
            assert_eq!(index.candidates(key.hash), vec![id.to_owned()]);
        }
    }

    #[test]
    fn jobs_sharing_a_hash_are_all_candidates_until_removed() {
        let mut index = ClaimIndex::default();
        let hash = ClaimKey::new("o", "k").hash;
        let minted = new_job_id("o", "k");
        let holder = |id: &str| Holder::new(hash, id);
        index.add(hash, holder(&minted));
        index.add(hash, holder("job_other"));
        index.add(hash, holder("job_other"));
        index.add(hash, holder(&minted));
        assert_eq!(index.len(), 2);
        let mut found = index.candidates(hash);
        found.sort();
        assert_eq!(found, vec![minted.clone(), "job_other".to_owned()]);
        index.remove(hash, &holder("job_other"));
        assert_eq!(index.candidates(hash), vec![minted.clone()]);
        assert!(matches!(
            index.holders[&hash],
            Holders::One(Holder::Minted(_))
        ));
        index.remove(hash, &holder("job_missing"));
        index.remove(hash + 1, &holder(&minted));
        assert_eq!(index.len(), 1);
        index.apply(Change::Remove(hash, holder(&minted)));
        assert!(index.candidates(hash).is_empty());
        assert_eq!(index.len(), 0);
        assert!(index.holders.is_empty());
    }

    #[test]
    fn a_claim_key_from_the_engine_s_identity_is_the_key_itself() {
        let identity = crate::job::claim_digest_bytes("owner", "key");
        assert_eq!(
            ClaimKey::with_identity("owner", "key", &identity),
            ClaimKey::new("owner", "key")
        );
        assert_eq!(ClaimKey::new("owner", "key").hash, hash_of("owner", "key"));
    }

    #[test]
    fn a_claim_key_names_only_its_own_owner_and_key() {
        let now = crate::clock::now();
        let policy = crate::job::ExpiryPolicy {
            retention: std::time::Duration::from_secs(60),
            late_result_window: std::time::Duration::from_secs(60),
        };
        let record = |owner: &str, key: &str| {
            crate::job::JobRecord::new(
                new_job_id(owner, key),
                owner.into(),
                key.into(),
                "fp".into(),
                "r".into(),
                now,
                now,
                &policy,
            )
        };
        let key = ClaimKey::new("ab", "c");
        assert!(key.names(&record("ab", "c")));
        assert!(!key.names(&record("a", "bc")));
        assert!(!key.names(&record("ab", "cd")));
        assert!(!key.names(&record("abc", "")));
        assert_eq!(key.bytes, b"ab\0c");
        assert_ne!(key.hash, ClaimKey::new("a", "bc").hash);
    }
}
