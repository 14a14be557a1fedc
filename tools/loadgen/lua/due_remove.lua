-- ===== due_remove.lua  KEYS: 1 = presence:due. ARGV: user_id, expected_score. Remove only if unchanged. =====
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
