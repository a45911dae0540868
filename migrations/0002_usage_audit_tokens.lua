-- kvgate migration 0002: the usage ledger, the audit log and named operator tokens.
--
-- Run by `kvgate migrate --redis URL` (RedisStore::migrate) as one EVAL, so it applies
-- atomically: KEYS[1] = kvgate:schema_version, KEYS[2] = kvgate:migrations, ARGV[1] = 2.
-- Returns 1 when applied, 0 when the keyspace was already at version 2 or later.
--
-- Version 2 adds (see README.md): the ledger stream kvgate:usage:records, the per-tenant daily
-- and monthly aggregates kvgate:usage:{tenant}:{YYYY-MM-DD | YYYY-MM}, the set
-- kvgate:usage:tenants, the batch markers kvgate:usage:batch:{id}, the audit stream
-- kvgate:audit, the operator tokens kvgate:optoken:{hash} with the set kvgate:optokens and the
-- name index kvgate:optoken_name:{name}, and the hash kvgate:key_last_used.
-- Key records gain optional fields (name, labels, expiry, limits, budget, successor) that an
-- older record simply lacks, so no record is rewritten. As in 0001, the migration refuses a
-- database where these names already hold other types.

local n = tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current == nil then
  return redis.error_reply('KVGATE_MIGRATION 0002: kvgate:schema_version is not a number')
end
if current >= n then
  return 0
end
if current < n - 1 then
  return redis.error_reply('KVGATE_MIGRATION 0002: the keyspace is at version ' .. current .. ', apply 0001 first')
end

local expected = {
  ['kvgate:usage:records'] = 'stream',
  ['kvgate:audit'] = 'stream',
  ['kvgate:usage:tenants'] = 'set',
  ['kvgate:optokens'] = 'set',
  ['kvgate:key_last_used'] = 'hash',
}
for key, want in pairs(expected) do
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= want then
    return redis.error_reply('KVGATE_MIGRATION 0002: ' .. key .. ' is a ' .. kind .. ', expected a ' .. want)
  end
end

local t = redis.call('TIME')
redis.call('HSET', KEYS[2], ARGV[1], t[1])
redis.call('SET', KEYS[1], ARGV[1])
return 1
