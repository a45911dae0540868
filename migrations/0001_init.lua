-- kvgate migration 0001: the initial keyspace.
--
-- Run by `kvgate migrate --redis URL` (RedisStore::migrate) as one EVAL, so it applies
-- atomically: KEYS[1] = kvgate:schema_version, KEYS[2] = kvgate:migrations, ARGV[1] = 1.
-- Returns 1 when applied, 0 when the keyspace was already at version 1 or later (a second run,
-- or another migrator that got there first), so running it again is a no-op.
--
-- Version 1 keyspace (see README.md): tenants, API key hashes, engines and rate-limit state.
-- Redis creates sets and records on first write, so there is nothing to pre-create; what this
-- migration does is refuse a database where something else already uses kvgate's registry
-- names with other types (a shared Redis, a half-restored dump), before any gateway writes to it.

local n = tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current == nil then
  return redis.error_reply('KVGATE_MIGRATION 0001: kvgate:schema_version is not a number')
end
if current >= n then
  return 0
end

for _, key in ipairs({'kvgate:tenants', 'kvgate:engines'}) do
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= 'set' then
    return redis.error_reply('KVGATE_MIGRATION 0001: ' .. key .. ' is a ' .. kind .. ', expected a set')
  end
end

local t = redis.call('TIME')
redis.call('HSET', KEYS[2], ARGV[1], t[1])
redis.call('SET', KEYS[1], ARGV[1])
return 1
