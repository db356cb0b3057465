//! The Lua scripts that make a claim and a transition single atomic steps in Redis. Every
//! job key a script touches shares the job's hash tag, so they run on one Cluster node. On a
//! standalone server the store-wide indexes (unknown jobs, in-progress jobs by lease) are
//! passed too and kept in the same script; on a Cluster they live in other slots, so the
//! store keeps them with separate commands and its lease sweep repairs what a crash between
//! the two left behind.

/// Creates the job unless the claim key names a live one; returns what it found. A claim
/// whose job is gone (its hash evicted, or expired first) is taken over. The key is read
/// first rather than taken with `SET NX`: inside the script both are atomic, and a failed
/// `SET NX` measured more of Redis's time added to a replay than it saved a new job.
pub(super) const CLAIM: &str = r#"
local existing = redis.call('GET', KEYS[1])
if existing then
  local rec = redis.call('HMGET', ARGV[4] .. existing, 'rev', 'blob')
  if rec[1] then
    local resp = redis.call('GET', ARGV[5] .. existing)
    return {0, existing, rec[1], rec[2], resp or ''}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], 'rev', 1, 'blob', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if KEYS[3] then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
end
return {1}
"#;

/// Replaces an expired job under its claim, if the claim still names it.
pub(super) const REPLACE: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[6] then
  return {0}
end
redis.call('DEL', ARGV[4] .. ARGV[6], ARGV[5] .. ARGV[6])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], 'rev', 1, 'blob', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if KEYS[3] then
  redis.call('ZREM', KEYS[3], ARGV[6])
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[1])
end
return {1}
"#;

/// Writes a transition's result if the record is still at the revision it was computed
/// from; otherwise returns the current record. An empty blob only checks the revision. The
/// record (hundreds of bytes, more as attempts accumulate) is read only when the revision
/// differs, so an apply that wins, nearly all of them, copies no record into Lua.
/// The change is published only while someone waits on the job (its `watch` key, KEYS[4],
/// exists): every gateway receives every publish through its pattern subscription, which
/// on a lone request cost the gateway a wake-up and Redis a second socket write per job.
pub(super) const APPLY: &str = r#"
local current = redis.call('HGET', KEYS[1], 'rev')
if not current then
  return {-1}
end
if current ~= ARGV[1] then
  return {0, current, redis.call('HGET', KEYS[1], 'blob')}
end
if ARGV[2] == '' then
  return {1, current}
end
local rev = tonumber(current) + 1
redis.call('HSET', KEYS[1], 'rev', rev, 'blob', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
if redis.call('GET', KEYS[3]) == ARGV[6] then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
if KEYS[5] then
  local index = ARGV[7]
  if string.sub(index, 1, 1) == 'p' then
    redis.call('ZADD', KEYS[6], string.sub(index, 2), ARGV[6])
    redis.call('SREM', KEYS[5], ARGV[6])
  elseif index == 'u' then
    redis.call('ZREM', KEYS[6], ARGV[6])
    redis.call('SADD', KEYS[5], ARGV[6])
  else
    redis.call('ZREM', KEYS[6], ARGV[6])
    redis.call('SREM', KEYS[5], ARGV[6])
  end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('PUBLISH', ARGV[5], rev)
end
return {1, tostring(rev)}
"#;

/// A new attempt's mirrored stream (SPEC §5): KEYS head, chunks, end, attempt; ARGV the
/// encoded head, its attempt number and the TTL in ms. The earlier attempt's chunks and end
/// go in the same step, so no reader sees the new head with the old chunks. A head of an
/// earlier attempt than the mirror's is dropped (returns 0): a cut attempt's mirror can
/// start late, after its retry's.
pub(super) const MIRROR_HEAD: &str = r#"
local mirrored = redis.call('GET', KEYS[4])
if mirrored and tonumber(mirrored) > tonumber(ARGV[2]) then
  return 0
end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// Appends to KEYS[1] (the chunks) the chunks of ARGV[4..] numbered from ARGV[2] that it
/// does not hold yet, so that a batch written again is not appended twice, and renews the
/// TTL (ARGV[3], ms) of the chunks, the head KEYS[3] and the attempt KEYS[2]; refuses a
/// batch that would leave a gap. Drops the batch (returns -1) unless the mirror is
/// attempt ARGV[1]'s.
pub(super) const PUSH_FROM: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return -1
end
local held = redis.call('LLEN', KEYS[1])
local from = tonumber(ARGV[2])
if from > held then
  return redis.error_reply('mirrored chunks missing before ' .. from)
end
for i = 4, #ARGV do
  if from + i - 4 >= held then
    redis.call('RPUSH', KEYS[1], ARGV[i])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return held
"#;

/// Marks the end (KEYS[1]) of attempt ARGV[1]'s mirrored stream with ARGV[2], for ARGV[3]
/// ms, unless the mirror (attempt KEYS[2]) is another attempt's by now.
pub(super) const MIRROR_END: &str = r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// A mirror as one snapshot: the end KEYS[1], the head KEYS[2] and the chunks KEYS[3] from
/// ARGV[1]; read in separate commands, a new attempt's head could come with the earlier
/// attempt's end.
pub(super) const MIRROR_READ: &str = r#"
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]),
  redis.call('LRANGE', KEYS[3], ARGV[1], -1)}
"#;
