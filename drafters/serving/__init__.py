"""The serving side: native checkpoint IO, export to the engines' layouts (layouts/), import of engine
directories, the doctor, and the vLLM engine check with its side-venv worker."""
