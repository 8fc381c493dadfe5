"""The simulated GPU backend, for hosts without an NVIDIA driver (development, demos, CI).

- `inventory`: the YAML file of simulated servers and cards, read and validated;
- `backend`: `SimulatedBackend`, the random walk of one server's cards;
- `local_jobs`: this portal's job processes on this machine, shown on the cards they booked;
- `declarations`: real processes declared with `manage.py simulate_gpu_process`.
"""
