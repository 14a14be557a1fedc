-- ===== presence_heartbeat.lua  ARGV: session_id, gen, ttl_ms  (hot path: no state recompute) =====
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[2] then return {0, 0} end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[1], 'hb', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now + ARGV[3], ARGV[1])
return {1, 0}
