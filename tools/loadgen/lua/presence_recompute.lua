-- ===== presence_recompute.lua  KEYS: 1 = user index, 2 = user meta. Returns {ver, live_until_ms} =====
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ver = 0
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZCARD', KEYS[1]) > 0
local was = redis.call('HGET', KEYS[2], 'state') == 'online'
if live ~= was then
  redis.call('HSET', KEYS[2], 'state', live and 'online' or 'offline')
  ver = redis.call('HINCRBY', KEYS[2], 'ver', 1)
end
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {ver, top[2] and tonumber(top[2]) or 0}
