-- wrk's load on `transduce serve`: POST /v1/translate, each request the next held-out sentence(s) of a file
-- (one per line, a TSV's first column), rotating, every thread from its own place. The independent cross-check
-- of `transduce loadtest --connections` (scripts/serve_bench.sh runs both at the same connection counts).
--
--   WRK_SENTENCES=sentences.txt WRK_BEAM_SIZE=4 WRK_SENTENCES_PER_REQUEST=1 [WRK_API_KEY=...] \
--     wrk -t 2 -c 64 -d 20s --timeout 60s -s scripts/wrk_translate.lua http://127.0.0.1:8000
--
-- At the end it prints one line, "wrk-json {...}": requests, requests and sentences per second, latency
-- percentiles in seconds, non-2xx answers and socket errors (connect, read, write, timeout).

local file = os.getenv("WRK_SENTENCES") or error("WRK_SENTENCES: the file of sentences to send is not set")
local beam = tonumber(os.getenv("WRK_BEAM_SIZE") or "1")
local per_request = tonumber(os.getenv("WRK_SENTENCES_PER_REQUEST") or "1")
local key = os.getenv("WRK_API_KEY")

local ESCAPES = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t'}

-- a JSON string of `s` (UTF-8 passes through; quotes, backslashes and control characters are escaped)
local function json_string(s)
   return '"' .. s:gsub('[%c"\\]', function(c) return ESCAPES[c] or string.format("\\u%04x", c:byte()) end) .. '"'
end

local sentences = {}
for line in io.lines(file) do
   local text = line:match("^([^\t]*)"):match("^%s*(.-)%s*$")
   if text ~= "" then sentences[#sentences + 1] = json_string(text) end
end
if #sentences == 0 then error(file .. " holds no sentences") end

local threads = 0
function setup(thread)  -- each thread starts from its own place in the rotation
   thread:set("offset", threads * 7919)
   threads = threads + 1
end

local requests, next_request = {}, 1
function init(args)
   local path = wrk.path:gsub("/$", "") .. "/v1/translate"
   local headers = {["Content-Type"] = "application/json", ["Accept"] = "application/json"}
   if key then headers["Authorization"] = "Bearer " .. key end
   local start = offset or 0
   for i = 1, #sentences do
      local texts = {}
      for j = 0, per_request - 1 do texts[#texts + 1] = sentences[(start + i - 1 + j) % #sentences + 1] end
      local body = '{"text": [' .. table.concat(texts, ", ") .. '], "beam_size": ' .. beam .. ', "stream": false}'
      requests[i] = wrk.format("POST", path, headers, body)
   end
end

function request()
   local r = requests[next_request]
   next_request = next_request % #requests + 1
   return r
end

function done(summary, latency, _)
   local seconds = summary.duration / 1e6
   local e = summary.errors
   io.write(string.format('wrk-json {"requests": %d, "duration_s": %.6f, "requests_per_s": %.3f, '
      .. '"sentences_per_s": %.3f, "sentences_per_request": %d, "latency_p50_s": %.6f, "latency_p90_s": %.6f, '
      .. '"latency_p99_s": %.6f, "non_2xx": %d, "socket_errors": %d}\n',
      summary.requests, seconds, summary.requests / seconds, summary.requests * per_request / seconds, per_request,
      latency:percentile(50) / 1e6, latency:percentile(90) / 1e6, latency:percentile(99) / 1e6, e.status,
      e.connect + e.read + e.write + e.timeout))
end
