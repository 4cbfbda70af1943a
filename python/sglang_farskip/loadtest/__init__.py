"""The load harness's library (bench/run_load.py and bench/crosscheck_sglang.py are its scripts,
bench/locustfile.py its locust users): per-request statistics (loadstats), the server's own
Prometheus figures (servermetrics), what a target server is (servers) and what a target behind
SGLang's router is (routers: its workers, their PD roles, the server each figure comes from),
prompts (workload), and the report with its plots (report, plots)."""
