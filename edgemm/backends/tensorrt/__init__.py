"""TensorRT engines: building them (build.py), describing them (manifest.py), the running
platform they must match (platform.py) and the QDQ → calibration-cache translation that DLA
INT8 needs on TensorRT <= 10.7 (qdq.py).

Only build.py and the backend import tensorrt, and only when called: everything here
imports on a machine without a GPU.
"""
