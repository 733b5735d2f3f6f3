"""The server's Prometheus metrics, in the text exposition format (written here: no client library).

Counters: requests by endpoint and status code, prompt and generated tokens, decode steps, and the rows those
steps decoded (`loom_decode_rows_total`: the sum of the batch size over decode steps, so rows / steps is the
mean batch; a value above the steps means requests were decoded together), prompt tokens looked up in and found in
the prefix cache (`loom_prefix_cache_queried_tokens_total`, `loom_prefix_cache_hit_tokens_total`). Gauges: waiting and running
requests, the largest decode batch seen. Histograms: time to first token and inter-token latency.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Thread-safe: HTTP handlers count requests, the scheduler thread counts steps, tokens and latencies."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_steps = 0
        self.decode_rows = 0
        self.max_batch = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_queried_tokens = 0
        self.spec_draft_tokens = self.spec_accepted_tokens = self.spec_request_steps = 0
        self.waiting = 0
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def add(self, **counts) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP loom_requests_total HTTP requests by endpoint and status code.",
                     "# TYPE loom_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'loom_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            scalars = [
                ("loom_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", self.prompt_tokens),
                ("loom_generation_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("loom_decode_steps_total", "counter", "Decode steps the engine ran.", self.decode_steps),
                ("loom_decode_rows_total", "counter", "Sum over decode steps of the requests each decoded (the "
                 "batch size); rows / steps is the mean batch.", self.decode_rows),
                ("loom_prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache "
                 "(paged keys and values).", self.prefix_cache_queried_tokens),
                ("loom_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache: their keys "
                 "and values were reused, not prefilled; hits / queried is the hit rate.", self.prefix_cache_hit_tokens),
                ("loom_spec_draft_tokens_total", "counter", "Tokens drafted by speculative decoding (--speculative).",
                 self.spec_draft_tokens),
                ("loom_spec_accepted_tokens_total", "counter", "Drafted tokens the target model accepted.",
                 self.spec_accepted_tokens),
                ("loom_spec_request_steps_total", "counter", "Requests verified, summed over speculative steps; "
                 "(accepted + request steps) / request steps is the tokens a request gains per step.",
                 self.spec_request_steps),
                ("loom_decode_batch_max", "gauge", "The most requests one decode step has decoded.", self.max_batch),
                ("loom_queue_length", "gauge", "Requests waiting for a slot.", self.waiting),
                ("loom_running_requests", "gauge", "Requests holding a slot.", self.running),
            ]
            for name, kind, help_, value in scalars:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
            for name, help_, hist in (
                    ("loom_time_to_first_token_seconds", "From a request's arrival to its first token.", self.ttft),
                    ("loom_inter_token_latency_seconds", "Between consecutive tokens of a request after its first "
                     "delivery (a decode window's tokens arrive together: each counts the time since the request's "
                     "previous delivery over the window's tokens).", self.itl)):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(lines) + "\n"
