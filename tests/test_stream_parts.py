"""A stream session's parts without a browser: the encoder's bitstream decodes frame by
frame, the codec string names the level the size needs, the scene turns with the camera,
a user's renderer plugs in, and what a page may send is judged (garbage, floods, inputs)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from gpuflow.tasks.stream import encode, metrics, scene
from gpuflow.tasks.stream.model import StreamFigures


def test_each_frame_in_gives_one_decodable_packet_out_at_once():
    import av

    encoder = encode.Encoder("x264", 320, 240, 30, 2000)
    decoder = av.CodecContext.create("h264", "r")
    shown = 0
    for i in range(12):
        frame = np.roll(np.arange(320 * 240 * 3, dtype=np.uint8).reshape(240, 320, 3), i, 1)
        packets = encoder.encode(frame)
        assert len(packets) == 1  # zero latency: no frame held back
        assert packets[0].key == (i == 0)
        assert packets[0].data.startswith(b"\x00\x00\x00\x01")  # Annex B
        for packet in decoder.parse(packets[0].data):
            shown += len(decoder.decode(packet))
    assert shown >= 11  # the decoder may hold the last until the next start code


@pytest.mark.parametrize(
    ("size", "fps", "codec"),
    [((1280, 720), 30, "avc1.42E01F"), ((1920, 1080), 30, "avc1.42E028"),
     ((1920, 1080), 60, "avc1.42E02A"), ((3840, 2160), 30, "avc1.42E033")],
)  # fmt: skip
def test_the_codec_string_names_the_level_the_size_and_rate_need(size, fps, codec):
    assert encode.codec_string(*size, fps) == codec


def test_nvenc_without_a_gpu_is_one_sentence_and_auto_takes_x264():
    with pytest.raises(encode.EncoderError) as caught:
        encode.choose("nvenc", gpus=False)
    assert str(caught.value).startswith("job.encoder: nvenc encodes on an NVIDIA GPU")
    assert encode.choose("auto", gpus=False) == ("x264", "x264 on the CPU (no GPU here)")


def test_the_built_in_scene_turns_with_the_camera_and_a_users_renderer_plugs_in():
    render, where = scene.load(None, 320, 180)
    assert "built-in scene" in where
    ahead = render(scene.Camera(0, 0), 0.0)
    assert ahead.shape == (180, 320, 3) and ahead.dtype == np.uint8
    assert not np.array_equal(ahead, render(scene.Camera(90, 0), 0.0))
    assert not np.array_equal(ahead, render(scene.Camera(0, 0), 1.0))  # the block moved
    camera = scene.Camera(355, 0)
    camera.turn(10, 100)
    assert (camera.yaw, camera.pitch) == (5, 60)  # around, and no further than up
    own, where = scene.load("tests.fixtures.stream.scene:make", 64, 32)
    assert where == "your renderer tests.fixtures.stream.scene:make"
    assert own(scene.Camera(42, 0), 0.0)[0, 0, 0] == 42


def test_a_page_is_cut_off_for_garbage_and_floods_and_its_inputs_move_the_camera():
    from gpuflow.tasks.stream.server import FLOOD_PER_S, Client

    class Args:
        width, height, fps, encoder, bitrate_kbps, clients = 64, 32, 30, "x264", 500, 2
        renderer = pushgateway = None
        run_id, job, push_interval_s = "", "stream", 2.0

    async def judge() -> None:
        from gpuflow.tasks.stream.server import Settings

        client = Client(1, Settings(Args()), ws=None)
        assert client.take(b"\x00binary") == "a binary message: a page sends JSON text only"
        assert client.take("{not json") == "a message that is not JSON"
        assert (
            client.take('{"t":"shell"}') == "a message of kind 'shell', which a page does not send"
        )
        assert client.take(json.dumps({"t": "input", "seq": 1, "key": "ArrowRight"})) is None
        assert client.camera.yaw == 5 and client.input_seq == 1
        assert client.take(json.dumps({"t": "input", "seq": 1, "key": "ArrowRight"})) == (
            "an input without a rising sequence number up to 4294967295"
        )
        assert client.take(json.dumps({"t": "input", "seq": 2, "key": "rm -rf"})) == (
            "an input that is neither a known key nor a mouse move"
        )
        assert client.take(json.dumps({"t": "stats", "frames": [[1, 2]]})) == (
            "stats that are not lists of figures"
        )
        said = {"t": "stats", "frames": [[20.0, 1.0, 2.0, 5.0]], "inputs": [30.0], "dropped": 1}
        assert client.take(json.dumps(said)) is None
        assert client.figures().capture_to_display.p50 == 20.0
        assert client.take(json.dumps({"t": "ping", "c": 5.0})) is None and client.replies
        why = None
        for _ in range(FLOOD_PER_S + 1):
            why = why or client.take(json.dumps({"t": "ping", "c": 1}))
        assert why == f"more than {FLOOD_PER_S} messages a second"

    asyncio.run(judge())


def test_the_push_names_each_clients_phases_by_quantile():
    done = StreamFigures.model_validate(
        {
            "client": "replica-1-client1", "width": 64, "height": 32, "encoder": "x264",
            "seconds": 1, "frames_sent": 30, "frames_shown": 29, "fps": 29.0,
            "bitrate_kbps": 700, "dropped": 1,
            "capture_to_display": {"p50": 10, "p95": 20, "p99": 30},
            "stages": {"encode": {"p50": 4, "p95": 5, "p99": 6}},
        }
    )  # fmt: skip
    text = metrics.exposition([done], {"flow_run_id": "r", "job": "j"})
    assert (
        'gpuflow_stream_latency_ms{flow_run_id="r",job="j",client="replica-1-client1",'
        'phase="capture_to_display",quantile="0.95"} 20.0'
    ) in text
    assert 'phase="encode",quantile="0.5"} 4.0' in text
    assert (
        'gpuflow_stream_dropped_frames_total{flow_run_id="r",job="j",client="replica-1-client1"} 1.0'
        in text
    )


def test_the_example_stream_spec_is_valid():
    from pathlib import Path

    from gpuflow.tasks.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "stream.yaml")
    job = spec.job
    assert job.kind == "stream" and (job.width, job.height) == (1920, 1080)
    assert job.replicas.max == 2 and job.scaling.connections == 1
    assert job.scaling.to_zero_after_s == 120 and "--width=1920" in job.command
