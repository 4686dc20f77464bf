"""Run inside Blender (`blender -b SCENE --python this -- [DEVICE]`): print what gpuflow
needs to know about the scene as one JSON line prefixed GPUFLOW-SCENE.

Not imported by gpuflow itself: it needs Blender's bpy. Only reads the scene.
"""

import json
import os
import sys

import bpy

MARK = "GPUFLOW-SCENE "


def _path(datablock, filepath):
    library = getattr(datablock, "library", None)
    return os.path.normpath(bpy.path.abspath(filepath, library=library)) if filepath else ""


def _references():
    found = []

    def add(kind, name, filepath, datablock=None, sequence=False):
        if not filepath:
            return
        path = _path(datablock, filepath)
        exists = os.path.exists(path)
        if sequence and not exists:  # image sequences: any file of the sequence will do
            folder = os.path.dirname(path) or "."
            stem = os.path.basename(path).rstrip("0123456789.#").split(".")[0].rstrip("0123456789")
            exists = os.path.isdir(folder) and any(f.startswith(stem) for f in os.listdir(folder))
        found.append({"kind": kind, "name": name, "path": path, "exists": exists})

    for image in bpy.data.images:
        if image.packed_file is None and image.source in {"FILE", "SEQUENCE", "MOVIE", "TILED"}:
            add("image", image.name, image.filepath, image, image.source != "FILE")
    for library in bpy.data.libraries:
        if library.packed_file is None:
            add("library", library.name, library.filepath)
    for cache in getattr(bpy.data, "cache_files", []):
        add("cache", cache.name, cache.filepath, cache)
    for volume in getattr(bpy.data, "volumes", []):
        if volume.packed_file is None:
            add("volume", volume.name, volume.filepath, volume, volume.is_sequence)
    for sound in bpy.data.sounds:
        if sound.packed_file is None:
            add("sound", sound.name, sound.filepath, sound)
    for font in bpy.data.fonts:
        if font.packed_file is None and font.filepath != "<builtin>":
            add("font", font.name, font.filepath, font)
    for text in bpy.data.texts:
        if text.filepath and not text.is_in_memory:
            add("text", text.name, text.filepath, text)
    for obj in bpy.data.objects:
        for modifier in obj.modifiers:
            settings = getattr(modifier, "point_cache", None)
            if settings is not None and settings.use_disk_cache:
                folder = bpy.path.abspath(
                    settings.filepath
                    or "//blendcache_" + bpy.path.basename(bpy.data.filepath).rsplit(".", 1)[0]
                )
                found.append(
                    {
                        "kind": "cache",
                        "name": f"{obj.name}/{modifier.name}",
                        "path": folder,
                        "exists": os.path.isdir(folder),
                    }
                )
    return found


def _devices(kind):
    try:
        prefs = bpy.context.preferences.addons["cycles"].preferences
        prefs.refresh_devices()
        return [d.name for d in prefs.get_devices_for_type(kind)]
    except Exception as exc:  # an old or stripped build: say so instead of failing
        return [f"unknown: {exc}"]


def _denoiser_built():
    try:
        import _cycles

        return bool(getattr(_cycles, "with_openimagedenoise", True))
    except ImportError:
        return True


def main():
    argv = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    scene = bpy.context.scene
    render = scene.render
    settings = render.image_settings
    info = {
        "blender": bpy.app.version_string,
        "scene": scene.name,
        "frame_start": scene.frame_start,
        "frame_end": scene.frame_end,
        "frame_step": scene.frame_step,
        "fps": render.fps / render.fps_base,
        "engine": render.engine,
        "camera": scene.camera.name if scene.camera else None,
        "resolution": [render.resolution_x, render.resolution_y, render.resolution_percentage],
        "file_format": settings.file_format,
        "output": render.filepath,
        "samples": getattr(scene.cycles, "samples", None) if hasattr(scene, "cycles") else None,
        "denoise": getattr(scene.cycles, "use_denoising", None)
        if hasattr(scene, "cycles")
        else None,
        "denoiser_built": _denoiser_built(),
        "references": _references(),
        "devices": {kind: _devices(kind) for kind in argv},
    }
    print(MARK + json.dumps(info), flush=True)


main()
