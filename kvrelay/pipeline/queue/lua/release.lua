-- Release entries: give those this consumer still owns to the `released` consumer, which never
-- beats, so the next claim scan of any worker takes them at once (shutdown, engine failure);
-- the requests' progress loses its owner (cancels go nowhere until the next admission reads
-- the flag) and their tails move to out:{id} (a tail is in its owner's tail hash); the
-- releasing worker, alive, writes nothing more for them. Never touches one another consumer
-- has claimed. XCLAIM JUSTID does not count a delivery.
-- KEYS: 1 work stream, 2 consumers hash, 3 prog hash, then out:{id} per pair
-- ARGV: 1 group, 2 consumer, 3 ttl_fields, 4 released consumer name, then entry id, request id
--       pairs
local stores = {}
for i = 5, #ARGV, 2 do
  local entry, rid = ARGV[i], ARGV[i + 1]
  if owns(KEYS[1], ARGV[1], entry, ARGV[2]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[4], 0, entry, 'JUSTID')
    local p = prog_parse(redis.call('HGET', KEYS[3], rid))
    if p and p.owner == ARGV[2] .. '/' .. entry then
      p = move_tail(KEYS[3], KEYS[3 + (i - 3) / 2], rid, p)
      p.owner = ''
      stores[#stores + 1] = rid
      stores[#stores + 1] = prog_encode(p)
    end
  end
end
redis.call('HSET', KEYS[2], ARGV[4], 0)
prog_store(KEYS[3], stores, ARGV[3])
return 0
