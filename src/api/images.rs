//! Images in user messages (REQ-BED-013): base64 with a media type, checked, resized so the
//! longer side fits the model's limit, then stored as attachments.

use std::io::Cursor;

use base64::Engine;
use image::{ImageFormat, ImageReader, Limits};

use super::error::ApiError;

/// An image ready to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub media_type: String,
    pub data: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

fn format_of(media_type: &str) -> Option<ImageFormat> {
    match media_type {
        "image/png" => Some(ImageFormat::Png),
        "image/jpeg" | "image/jpg" => Some(ImageFormat::Jpeg),
        "image/gif" => Some(ImageFormat::Gif),
        "image/webp" => Some(ImageFormat::WebP),
        _ => None,
    }
}

/// Decodes, checks and resizes one image. CPU-bound: call it off the async threads.
pub fn prepare(
    index: usize,
    media_type: &str,
    data: &str,
    max_px: u32,
) -> Result<Prepared, ApiError> {
    let Some(format) = format_of(media_type) else {
        return Err(ApiError::invalid(format!(
            "images[{index}]: media_type {media_type:?} is not supported; use image/png, image/jpeg, image/gif or image/webp"
        )));
    };
    // Accept a data URL as well as bare base64.
    let data = data
        .split_once(";base64,")
        .map_or(data, |(_, b64)| b64)
        .trim();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| {
            ApiError::invalid(format!("images[{index}]: data is not valid base64: {e}"))
        })?;
    let mut reader = ImageReader::with_format(Cursor::new(&bytes), format);
    let mut limits = Limits::default();
    limits.max_image_width = Some(16_384);
    limits.max_image_height = Some(16_384);
    // At most a 33-megapixel RGBA canvas (8K video is 33.2): found by fuzzing, 44 bytes of
    // GIF that declare an 8441 x 6913 canvas made a 233 MB buffer and seconds of resizing.
    limits.max_alloc = Some(128 * 1024 * 1024);
    reader.limits(limits);
    let image = reader.decode().map_err(|e| {
        ApiError::invalid(format!(
            "images[{index}]: not a valid {media_type} image: {e}"
        ))
    })?;
    let (width, height) = (image.width(), image.height());
    if width.max(height) <= max_px {
        return Ok(Prepared {
            media_type: if media_type == "image/jpg" {
                "image/jpeg".into()
            } else {
                media_type.to_owned()
            },
            data: bytes,
            width,
            height,
        });
    }
    let resized = image.resize(max_px, max_px, image::imageops::FilterType::Lanczos3);
    // JPEG stays JPEG; the rest become PNG (lossless, and every backend reads it).
    let jpeg = format == ImageFormat::Jpeg;
    let (out_format, out_type) = if jpeg {
        (ImageFormat::Jpeg, "image/jpeg")
    } else {
        (ImageFormat::Png, "image/png")
    };
    let mut out = Vec::new();
    let encodable = if jpeg {
        image::DynamicImage::ImageRgb8(resized.to_rgb8())
    } else {
        resized
    };
    encodable
        .write_to(&mut Cursor::new(&mut out), out_format)
        .map_err(|e| {
            ApiError::internal(format!(
                "images[{index}]: could not re-encode the image: {e}"
            ))
        })?;
    Ok(Prepared {
        media_type: out_type.to_owned(),
        width: encodable.width(),
        height: encodable.height(),
        data: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: a tiny GIF declaring a huge canvas is refused, not decoded.
    #[test]
    fn a_tiny_image_with_a_huge_canvas_is_refused() {
        let bomb = "R0lGODlh+SABG4AAAP//AP8AACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw==";
        let started = std::time::Instant::now();
        let refused = prepare(0, "image/gif", bomb, 1024);
        assert!(
            refused.is_err(),
            "decoded: {:?}",
            refused.map(|p| (p.width, p.height))
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    fn png(width: u32, height: u32) -> String {
        let image = image::RgbImage::from_pixel(width, height, image::Rgb([200, 10, 10]));
        let mut out = Vec::new();
        image::DynamicImage::ImageRgb8(image)
            .write_to(&mut Cursor::new(&mut out), ImageFormat::Png)
            .expect("a png encodes");
        base64::engine::general_purpose::STANDARD.encode(out)
    }

    #[test]
    fn large_images_are_resized_small_ones_kept() {
        let big = prepare(0, "image/png", &png(400, 200), 100).expect("a valid image");
        assert_eq!((big.width, big.height), (100, 50));
        assert_eq!(big.media_type, "image/png");
        let small = prepare(0, "image/png", &png(20, 10), 100).expect("a valid image");
        assert_eq!((small.width, small.height), (20, 10));
        let url = format!("data:image/png;base64,{}", png(5, 5));
        assert!(prepare(0, "image/png", &url, 100).is_ok());
    }

    #[test]
    fn bad_images_are_clear_400s() {
        let wrong_type = prepare(0, "image/tiff", &png(2, 2), 100).expect_err("unsupported");
        assert_eq!(wrong_type.code, "invalid_request");
        assert!(
            prepare(1, "image/png", "not base64!!", 100)
                .expect_err("bad base64")
                .message
                .contains("images[1]")
        );
        let not_png = base64::engine::general_purpose::STANDARD.encode(b"hello");
        assert!(
            prepare(0, "image/png", &not_png, 100)
                .expect_err("not an image")
                .message
                .contains("not a valid image/png")
        );
        let jpeg_labelled_png = prepare(0, "image/jpeg", &png(2, 2), 100);
        assert!(jpeg_labelled_png.is_err());
    }
}
