"""The load harness's library (bench/run_load.py and bench/crosscheck_sglang.py are its scripts,
bench/locustfile.py its locust users): per-request statistics (loadstats), the server's own
Prometheus figures (servermetrics), what a target server is (servers), prompts (workload), and
the report with its plots (report, plots)."""
