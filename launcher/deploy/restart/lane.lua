-- Rendered beside the front's config by llama-launcher (launcher/deploy/restart/lane.py says
-- why and how): the long-prompt lane, inside HAProxy.
--
-- A POST whose body is longer than `bytes` (the threshold in tokens times the bytes a token
-- takes at least in the prompts it is set for; the front sees the body's length, not its
-- tokens) goes to the lane's server (txn.llama_lane: the frontend's use_backend), the rest to
-- the main one. A lane request waits here while the lane is held (a deploy of the lane:
-- `llama lane hold SECONDS`, until `llama lane release` or the hold's deadline) or down (its
-- health check), never sent to the main pool; past `wait` seconds (counted from its arrival,
-- or from the end of a hold it waited through): 503 with Retry-After. A lane taken out while
-- requests wait for it (`llama lane set 0`) sends them to the main server. A body sent in chunks (no Content-Length) has no length to route by: it
-- goes to the main server. `bytes` 0: no lane, every request to the main server.

local lane = {
  bytes = tonumber(os.getenv("LLAMA_LANE_BYTES") or "0") or 0,
  wait = tonumber(os.getenv("LLAMA_LANE_WAIT") or "120") or 120,
  hold_until = 0,
  poll_ms = 50,
}

-- what `llama lane` shows (launcher.deploy.restart.lane.Ledger parses it)
local st = { routed = 0, main = 0, waited = 0, refused_wait = 0 }
-- the requests waiting for the lane, by ticket: when each last looked. A client that leaves
-- ends this action where it sleeps (option abortonclose), so its entry is not removed:
-- one that has not looked for a second is no longer waiting
local waiting = {}
local next_ticket = 0

local function now()
  local t = core.now()
  return t.sec + t.usec / 1e6
end

-- the lane's server as its health check last saw it: UP (or going down: "UP 1/2") serves
local function lane_up()
  local be = core.backends["lane"]
  local sv = be and be.servers["lane"]
  if sv == nil then return false end
  local status = sv:get_stats()["status"] or ""
  return status:sub(1, 2) == "UP" or status == "no check"
end

local function still_waiting()
  local n, t = 0, now()
  for ticket, seen in pairs(waiting) do
    if t - seen < 1 then n = n + 1 else waiting[ticket] = nil end
  end
  return n
end

local function unavailable(txn, message, retry)
  st.refused_wait = st.refused_wait + 1
  local body = string.format('{"error":{"code":503,"message":"%s","type":"unavailable_error"}}', message)
  txn:done(txn:reply({ status = 503, reason = "Service Unavailable",
    headers = { ["content-type"] = { "application/json; charset=utf-8" },
                ["retry-after"] = { tostring(retry) } },
    body = body }))
end

core.register_action("llama_lane", { "http-req" }, function(txn)
  if lane.bytes <= 0 then return end
  local length = tonumber(txn.f:req_hdr("content-length") or "")
  if length == nil or length <= lane.bytes then
    st.main = st.main + 1
    return
  end
  txn:set_var("txn.llama_lane", 1)
  next_ticket = next_ticket + 1
  local ticket = next_ticket
  -- a request waits at most `wait` seconds for a lane that is down, counted from its arrival
  -- or from the end of a hold it waited through
  local since = now()
  local waited = false
  while now() < lane.hold_until or not lane_up() do
    waiting[ticket] = now()
    if lane.bytes <= 0 then
      -- the lane was taken out (llama lane set 0): the main server takes it
      waiting[ticket] = nil
      txn:set_var("txn.llama_lane", 0)
      st.main = st.main + 1
      return
    end
    if now() < lane.hold_until then since = now() end
    if now() - since > lane.wait then
      waiting[ticket] = nil
      unavailable(txn, string.format("the long-prompt lane did not serve within %g s; try again later", lane.wait), 5)
      return
    end
    local stopping = txn.f:stopping()  -- a boolean fetch comes to Lua as a number
    if stopping == true or stopping == 1 then
      waiting[ticket] = nil
      unavailable(txn, "the front is restarting; try again", 1)
      return
    end
    waited = true
    core.msleep(lane.poll_ms)
  end
  waiting[ticket] = nil
  st.routed = st.routed + 1
  if waited then st.waited = st.waited + 1 end
end, 0)

local function show(applet)
  local left = math.max(0, lane.hold_until - now())
  local lines = {
    "bytes " .. lane.bytes, "wait_limit " .. lane.wait,
    "held " .. (left > 0 and 1 or 0), string.format("hold_left %.3f", left),
    "up " .. (lane_up() and 1 or 0), "waiting " .. still_waiting(),
  }
  for k, v in pairs(st) do lines[#lines + 1] = k .. " " .. v end
  applet:send(table.concat(lines, "\n") .. "\n")
end

-- `llama lane`: the lane's state; `llama lane set BYTES`: the threshold (0: no lane);
-- `llama lane hold SECONDS`: its requests wait at the front; `llama lane release`
core.register_cli({ "llama", "lane" }, "llama lane [set BYTES | hold SECONDS | release] : the long-prompt lane",
  function(applet, a, b, verb, value)
    if verb == "set" or verb == "hold" then
      local n = tonumber(value)
      if n == nil or n < 0 then
        applet:send("usage: llama lane set BYTES | hold SECONDS | release\n")
        return
      end
      if verb == "set" then lane.bytes = n else lane.hold_until = now() + n end
      applet:send(verb .. "\n")
      return
    end
    if verb == "release" then
      lane.hold_until = 0
      applet:send("release\n")
      return
    end
    show(applet)
  end)
