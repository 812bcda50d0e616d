#!/usr/bin/env python3
"""A small CRI client for the Kubernetes phase of the e2e VM (tests/e2e/kube.sh): what kubelet
asks of containerd, without kubelet or crictl (Debian ships neither). Speaks gRPC through
python3-grpcio with the few CRI messages it needs encoded by hand from the published API
(k8s.io/cri-api, runtime.v1: field numbers are the wire protocol's). Also builds the OCI image
archives the guest imports with `ctr -n k8s.io images import`: no registry is reachable.

  cri.py image NAME ROOTFS_DIR OUT.tar CMD...   an OCI image of ROOTFS_DIR running CMD
  cri.py version
  cri.py run-pod NAME UID CGROUP_PARENT [KEY=VALUE annotation...]     prints the pod id
  cri.py create POD_ID POD_NAME UID CGROUP_PARENT CTR_NAME IMAGE [KEY=VALUE...] -- CMD...
                                                                      prints the container id
  cri.py start CTR_ID | stop CTR_ID | remove CTR_ID
  cri.py stop-pod POD_ID | remove-pod POD_ID
"""
import hashlib
import io
import json
import os
import sys
import tarfile

SOCKET = "unix:///run/containerd/containerd.sock"
SERVICE = "/runtime.v1.RuntimeService/"
NAMESPACE = "e2e"


# --- protobuf wire format, by hand ---
def varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, n):
    return varint(num << 3) + varint(n) if n else b""


def field_bytes(num, data):
    if isinstance(data, str):
        data = data.encode()
    return varint(num << 3 | 2) + varint(len(data)) + data


def field_map(num, mapping):
    return b"".join(
        field_bytes(num, field_bytes(1, k) + field_bytes(2, v)) for k, v in mapping.items()
    )


def fields(data):
    """(number, wire type, value) of each field of a message."""
    i = 0
    while i < len(data):
        key, i = read_varint(data, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            value, i = read_varint(data, i)
        elif wt == 2:
            n, i = read_varint(data, i)
            value, i = data[i : i + n], i + n
        elif wt == 1:
            value, i = data[i : i + 8], i + 8
        elif wt == 5:
            value, i = data[i : i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        yield num, wt, value


def read_varint(data, i):
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def string_field(data, num):
    for n, wt, v in fields(data):
        if n == num and wt == 2:
            return v.decode()
    return ""


# --- CRI messages ---
NODE = 2  # NamespaceMode: the host's (no CNI needed for the network)


def sandbox_config(name, uid, cgroup_parent, annotations):
    metadata = field_bytes(1, name) + field_bytes(2, uid) + field_bytes(3, NAMESPACE)
    namespaces = field_varint(1, NODE) + field_varint(2, 1) + field_varint(3, 0)
    security = field_bytes(1, namespaces)
    linux = field_bytes(1, cgroup_parent) + field_bytes(2, security)
    return (
        field_bytes(1, metadata)
        # No hostname: a pod on the host's network has the host's (kubelet sends none either).
        + field_bytes(3, f"/var/log/pods/{name}")
        + field_map(7, annotations)
        + field_bytes(8, linux)
    )


def call(method, request):
    import grpc  # python3-grpcio, in the guest only

    with grpc.insecure_channel(SOCKET) as channel:
        return channel.unary_unary(SERVICE + method)(request, timeout=60)


def pairs(args):
    return dict(a.split("=", 1) for a in args)


def main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "image":
        return image(args[0], args[1], args[2], args[3:])
    if cmd == "version":
        rsp = call("Version", field_bytes(1, "v1"))
        print(string_field(rsp, 2), string_field(rsp, 3))
    elif cmd == "run-pod":
        name, uid, parent = args[:3]
        req = field_bytes(1, sandbox_config(name, uid, parent, pairs(args[3:])))
        print(string_field(call("RunPodSandbox", req), 1))
    elif cmd == "create":
        pod_id, pod_name, uid, parent, ctr, img = args[:6]
        rest = args[6:]
        sep = rest.index("--")
        annotations, command = pairs(rest[:sep]), rest[sep + 1 :]
        config = (
            field_bytes(1, field_bytes(1, ctr))
            + field_bytes(2, field_bytes(1, img))
            + b"".join(field_bytes(3, c) for c in command[:1])
            + b"".join(field_bytes(4, c) for c in command[1:])
            + field_map(10, annotations)
            + field_bytes(11, f"{ctr}.log")
        )
        req = (
            field_bytes(1, pod_id)
            + field_bytes(2, config)
            + field_bytes(3, sandbox_config(pod_name, uid, parent, {}))
        )
        print(string_field(call("CreateContainer", req), 1))
    elif cmd in ("start", "remove"):
        call({"start": "StartContainer", "remove": "RemoveContainer"}[cmd], field_bytes(1, args[0]))
    elif cmd == "stop":
        call("StopContainer", field_bytes(1, args[0]) + field_varint(2, 5))
    elif cmd in ("stop-pod", "remove-pod"):
        method = {"stop-pod": "StopPodSandbox", "remove-pod": "RemovePodSandbox"}[cmd]
        call(method, field_bytes(1, args[0]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


# --- an OCI image archive of a directory ---
def image(name, rootfs, out, command):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
        for entry in sorted(os.listdir(rootfs)):
            t.add(os.path.join(rootfs, entry), arcname=entry)
    layer = layer.getvalue()
    digest = lambda b: "sha256:" + hashlib.sha256(b).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": command, "Env": ["PATH=/bin:/usr/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [digest(layer)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": digest(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": digest(layer),
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": digest(manifest),
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
    ).encode()
    with tarfile.open(out, "w") as t:
        def put(path, data):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))

        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        put("index.json", index)
        for blob in (layer, config, manifest):
            put("blobs/sha256/" + hashlib.sha256(blob).hexdigest(), blob)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
