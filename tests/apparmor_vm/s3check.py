"""Talk to the guest's moto S3 server from outside any mount: create the bucket, read an object.

    python3 s3check.py wait-bucket BUCKET TIMEOUT   create BUCKET once the server answers
    python3 s3check.py get BUCKET KEY               print the object's body (exit 1 if absent)

Plain HTTP from the standard library: importing boto3 costs seconds under emulation. moto
identifies the caller by the Authorization header's credential and does not verify signatures,
so the header names the same access key s3fs uses and carries no real signature.
"""

import sys
import time
import urllib.error
import urllib.request

ENDPOINT = "http://127.0.0.1:5000"
AUTH = (
    "AWS4-HMAC-SHA256 Credential=fdptest/20260101/us-east-1/s3/aws4_request, "
    "SignedHeaders=host, Signature=0"
)


def request(method: str, path: str) -> bytes:
    req = urllib.request.Request(ENDPOINT + path, method=method, headers={"Authorization": AUTH})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bytes(resp.read())


def main() -> int:
    cmd = sys.argv[1]
    if cmd == "wait-bucket":
        bucket, deadline = sys.argv[2], time.monotonic() + float(sys.argv[3])
        while True:
            try:
                request("PUT", f"/{bucket}")
                return 0
            except (ConnectionError, urllib.error.URLError) as exc:
                if isinstance(exc, urllib.error.HTTPError) or time.monotonic() > deadline:
                    print(f"s3check: moto server: {exc}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
    if cmd == "get":
        try:
            sys.stdout.write(request("GET", f"/{sys.argv[2]}/{sys.argv[3]}").decode())
        except urllib.error.HTTPError as exc:
            print(f"s3check: GET: {exc}", file=sys.stderr)
            return 1
        return 0
    print(f"s3check: unknown command {cmd}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
