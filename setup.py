from setuptools import find_packages, setup

# config/, lab_practice/ and lab_calib/ stay at the top level (where msModelSlim users look for them) and ship in
# the wheel as msmodelslim/resources/<folder>/ (msmodelslim.core.resources.resource_path finds either place).
RESOURCES = {
    "config": ["*.ini"],
    "lab_practice": ["*.md", "*/*.yaml", "*/*/*.yaml"],
    "lab_calib": ["*.md", "*.py", "*/*.jsonl", "*/*.md", "*/images/*.png"],
}

setup(
    name="msmodelslim",
    version="0.1.0",
    description="Post-training quantization toolkit (msModelSlim style) for Kimi-K3 and friends",
    packages=find_packages(include=["msmodelslim", "msmodelslim.*"]) + [f"msmodelslim.resources.{r}" for r in RESOURCES],
    package_dir={f"msmodelslim.resources.{r}": r for r in RESOURCES},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6,<2.15",
        # Kimi-K3's release environment (transformers 4.57.6, compressed-tensors 0.13.0: seed 004's install line)
        # through today's pins; `make test` runs the Kimi-K3 tests under both ends.
        "transformers>=4.57.6,<=5.23.0",
        "compressed-tensors>=0.13.0,<=0.20.0",
        "fla-core==0.6.0",
        "safetensors>=0.5,<0.9",
        "pyyaml>=6.0,<7",
        "tqdm>=4.66,<5",
        "pillow>=10,<14",
        "packaging>=23,<27",
    ],
    extras_require={
        # fla-core imports `triton` at module import time, also on CPU hosts.
        "cpu": ["triton>=3.2,<3.10"],
        "dev": ["pytest>=8,<10", "ruff==0.17.6", "triton>=3.2,<3.10"],
        # torch_npu of the installed torch's version, and triton-ascend: fla (the checkpoint's KDA code) imports
        # `triton` at import time; fla-core 0.6.0's own npu extra pins triton-ascend==3.6.0, which PyPI lacks
        "npu": ["torch_npu>=2.6,<2.15", "triton-ascend"],
    },
    include_package_data=True,
    package_data={**{f"msmodelslim.resources.{r}": globs for r, globs in RESOURCES.items()},
                  "msmodelslim.core": ["ascend_a2a3_rules.json"], "msmodelslim.app": ["plan_records.json"]},
    entry_points={"console_scripts": ["msmodelslim=msmodelslim.cli.main:main"]},
)
