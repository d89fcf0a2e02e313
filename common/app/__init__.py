"""The application on top of the stages: the command line (`python -m common`), chat, the
measurement harness, the report and its charts and pages, profiling, the machine probe, model
fetching and the llama.cpp baseline. It imports the engine (common/) and the stages; neither
imports it."""
