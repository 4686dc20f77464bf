"""Run inside Blender (`blender -b --python this -- OUT.blend [FRAMES] [SIZE]`): save a
small animated scene (a turning, moving cube, a light, a camera) for demos and tests.

Not imported by gpuflow itself: it needs Blender's bpy.
"""

import os
import sys

import bpy

argv = sys.argv[sys.argv.index("--") + 1 :]
target = argv[0]
frames = int(argv[1]) if len(argv) > 1 else 24
size = int(argv[2]) if len(argv) > 2 else 64

bpy.ops.wm.read_factory_settings(use_empty=False)
scene = bpy.context.scene
scene.frame_start, scene.frame_end = 1, frames
scene.render.engine = "CYCLES"
scene.cycles.samples = 4
scene.cycles.use_denoising = False
scene.render.resolution_x = scene.render.resolution_y = size
scene.render.resolution_percentage = 100
scene.render.image_settings.file_format = "PNG"
cube = bpy.data.objects["Cube"]
material = bpy.data.materials.new("demo")
material.diffuse_color = (0.9, 0.3, 0.1, 1.0)
material.use_nodes = True
material.node_tree.nodes["Principled BSDF"].inputs["Base Color"].default_value = (0.9, 0.3, 0.1, 1)
cube.data.materials.append(material)
cube.location = (-1.5, 0, 0)
cube.rotation_euler = (0, 0, 0)
cube.keyframe_insert("location", frame=1)
cube.keyframe_insert("rotation_euler", frame=1)
cube.location = (1.5, 0, 0)
cube.rotation_euler = (0, 0, 3.14159)
cube.keyframe_insert("location", frame=frames)
cube.keyframe_insert("rotation_euler", frame=frames)
os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
bpy.ops.wm.save_as_mainfile(filepath=target)
