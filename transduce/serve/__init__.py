"""Serving: the running batch behind an HTTP API (`transduce serve`) and as a Ray Serve deployment.

service.py  the decode service: a bounded queue and one decode thread driving the running batch
options.py  its options (ServiceOptions) and ServeError
app.py      the HTTP API, a raw ASGI app over it; asgi.py its plumbing (bodies, JSON, errors)
stream.py   the decode thread's step messages into the event loop; streamed text detokenised incrementally
libre.py    LibreTranslate's POST /translate and GET /languages
server.py   uvicorn, signals and draining; `transduce serve`
ray.py      the Ray Serve deployment: one service per replica
loadtest.py `transduce loadtest`: Poisson (open-loop) or closed-loop load on running servers, its report
loadgen.py  the closed loop's lean generator: keep-alive connections over several processes
loadcost.py the server's CPU seconds per request (/metrics) and offline decoding to compare with
metrics.py  the Prometheus metrics

The commands are transduce.cli.serve.
"""
