"""Talk to the guest's moto S3 server from outside any mount: create the bucket, read an object.

    python3 s3check.py wait-bucket BUCKET TIMEOUT   create BUCKET once the server answers
    python3 s3check.py get BUCKET KEY               print the object's body (exit 1 if absent)
"""

import sys
import time

import boto3
import botocore.exceptions

ENDPOINT = "http://127.0.0.1:5000"


def client():  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=ENDPOINT,
        aws_access_key_id="fdptest",
        aws_secret_access_key="fdptestsecret",
        region_name="us-east-1",
    )


def main() -> int:
    cmd = sys.argv[1]
    s3 = client()
    if cmd == "wait-bucket":
        bucket, deadline = sys.argv[2], time.monotonic() + float(sys.argv[3])
        while True:
            try:
                s3.create_bucket(Bucket=bucket)
                return 0
            except botocore.exceptions.EndpointConnectionError:
                if time.monotonic() > deadline:
                    print("s3check: moto server did not answer in time", file=sys.stderr)
                    return 1
                time.sleep(0.5)
    if cmd == "get":
        try:
            body = s3.get_object(Bucket=sys.argv[2], Key=sys.argv[3])["Body"].read()
        except botocore.exceptions.ClientError as exc:
            print(f"s3check: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write(body.decode())
        return 0
    print(f"s3check: unknown command {cmd}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
