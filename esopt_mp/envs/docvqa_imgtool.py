"""imgtool: crop / scale / threshold / info for a document image, so an agent can zoom in before OCR.

Shipped into each DocVQA bash call's workspace (on PATH as ``imgtool``); stdlib + Pillow only, because it runs
inside the sandbox where the project is not importable. Usage::

    imgtool info IN
    imgtool crop IN OUT LEFT TOP RIGHT BOTTOM     # pixels, or fractions of the size when all are <= 1;
                                                  # clipped to the image
    imgtool scale IN OUT FACTOR
    imgtool threshold IN OUT [LEVEL]              # grey, then black/white at LEVEL (default 128)
    imgtool gray IN OUT
"""
import sys


def main(argv):
    """One operation; a bad argument or file is one line on stderr (exit 1), never a traceback."""
    try:
        run(argv)
    except (OSError, ValueError) as e:
        sys.exit(f"imgtool: {e}")


def run(argv):
    from PIL import Image

    if len(argv) < 2 or argv[0] not in ("info", "crop", "scale", "threshold", "gray"):
        sys.exit(__doc__.split("Usage::", 1)[1].rstrip())
    op, src = argv[0], argv[1]
    img = Image.open(src)
    if op == "info":
        print(f"{img.width}x{img.height} {img.mode}")
        return
    if len(argv) < 3:
        sys.exit(f"imgtool {op}: missing OUT")
    out, args = argv[2], [float(a) for a in argv[3:]]
    if op == "crop":
        if len(args) != 4:
            sys.exit("imgtool crop IN OUT LEFT TOP RIGHT BOTTOM")
        if all(0 <= a <= 1 for a in args):
            args = [a * (img.width if i % 2 == 0 else img.height) for i, a in enumerate(args)]
        left, top, right, bottom = (int(max(0, min(a, img.width if i % 2 == 0 else img.height)))
                                    for i, a in enumerate(args))  # past the edge: clipped, not padded
        if right <= left or bottom <= top:
            sys.exit(f"imgtool crop: empty box {left},{top},{right},{bottom} within {img.width}x{img.height}; "
                     "need LEFT < RIGHT and TOP < BOTTOM")
        img = img.crop((left, top, right, bottom))
    elif op == "scale":
        if len(args) != 1 or not 0 < args[0] <= 8:
            sys.exit("imgtool scale IN OUT FACTOR (0 < FACTOR <= 8)")
        img = img.resize((max(1, int(img.width * args[0])), max(1, int(img.height * args[0]))), Image.LANCZOS)
    elif op == "threshold":
        level = args[0] if args else 128
        img = img.convert("L").point(lambda v: 255 if v >= level else 0)
    else:
        img = img.convert("L")
    img.save(out)
    print(f"wrote {out} {img.width}x{img.height}")


if __name__ == "__main__":
    main(sys.argv[1:])
