-- ===== presence_register.lua   ARGV: session_id, gateway_id, ttl_ms =====
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local gen = redis.call('HINCRBY', KEYS[3], 'gen', 1)
redis.call('HSET', KEYS[1], 'gateway', ARGV[2], 'gen', gen, 'hb', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now + ARGV[3], ARGV[1])
local ver = 0
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local live = redis.call('ZCARD', KEYS[2]) > 0
local was = redis.call('HGET', KEYS[3], 'state') == 'online'
if live ~= was then
  redis.call('HSET', KEYS[3], 'state', live and 'online' or 'offline')
  ver = redis.call('HINCRBY', KEYS[3], 'ver', 1)
end
return {gen, ver}
