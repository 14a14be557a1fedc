-- ===== presence_unregister.lua  ARGV: session_id, gen  (compare-and-delete) =====
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[2] then return {0, 0} end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local ver = 0
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local live = redis.call('ZCARD', KEYS[2]) > 0
local was = redis.call('HGET', KEYS[3], 'state') == 'online'
if live ~= was then
  redis.call('HSET', KEYS[3], 'state', live and 'online' or 'offline')
  ver = redis.call('HINCRBY', KEYS[3], 'ver', 1)
end
return {1, ver}
