//! How large an image the store takes. A pull or import is hostile input: a gzip layer of a few
//! megabytes can expand to tens of gigabytes, a layer can hold millions of empty files, a
//! manifest can claim any size and any number of layers. Each is checked before the store
//! writes what it would cost: the manifest's layer count and claimed sizes before anything is
//! fetched, the bytes a registry sends against what the manifest claimed, and each entry of
//! each layer — its bytes and one 4 KiB block for the entry itself, so empty files count — as
//! it is unpacked, against one budget for the whole image. What was refused is removed (the
//! actors collect the blobs an add left once it failed).

use super::ImageError;

/// What one image may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// The most layers (`sbxd serve --image-max-layers`; Docker's limit is 127).
    pub max_layers: usize,
    /// The most bytes its layers unpack to, and its manifest may claim (`--image-max-size`).
    pub max_size: u64,
    /// The most entries (files, directories, links) its layers hold (`--image-max-files`).
    pub max_files: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_layers: 127,
            max_size: 20 << 30,
            max_files: 500_000,
        }
    }
}

/// What an entry costs besides its bytes: one block for its inode and directory entry.
pub const ENTRY_COST: u64 = 4096;

impl ImageLimits {
    /// The manifest's layers: their count and the sizes they claim.
    pub fn check_manifest(&self, image: &str, sizes: &[u64]) -> Result<(), ImageError> {
        self.check_layers(image, sizes.len())?;
        let claimed = sizes.iter().fold(0u64, |sum, s| sum.saturating_add(*s));
        if claimed > self.max_size {
            return Err(self.too_large(
                image,
                format!(
                    "its manifest claims {} of layers",
                    sbx_proto::quantity::human_bytes(claimed)
                ),
                self.size_limit(),
            ));
        }
        Ok(())
    }

    /// How many layers an image has (a `docker save` archive claims no sizes).
    pub fn check_layers(&self, image: &str, layers: usize) -> Result<(), ImageError> {
        if layers > self.max_layers {
            return Err(self.too_large(
                image,
                format!("its manifest lists {layers} layers"),
                format!("{} layers, --image-max-layers", self.max_layers),
            ));
        }
        Ok(())
    }

    fn size_limit(&self) -> String {
        format!(
            "{}, --image-max-size",
            sbx_proto::quantity::human_bytes(self.max_size)
        )
    }

    fn too_large(&self, image: &str, why: String, limit: String) -> ImageError {
        ImageError::TooLarge {
            image: image.to_string(),
            why,
            limit,
        }
    }

    /// A fresh budget for one image.
    pub fn budget(&self, image: &str) -> Budget {
        Budget {
            image: image.to_string(),
            limits: *self,
            bytes: 0,
            files: 0,
        }
    }
}

/// What an image's layers have cost so far, as they are unpacked.
#[derive(Debug)]
pub struct Budget {
    image: String,
    limits: ImageLimits,
    bytes: u64,
    files: u64,
}

impl Budget {
    /// No limit: the built-in image, made from the host's own busybox.
    pub fn unlimited(image: &str) -> Budget {
        ImageLimits {
            max_layers: usize::MAX,
            max_size: u64::MAX,
            max_files: u64::MAX,
        }
        .budget(image)
    }

    /// One more entry of `size` bytes, refused (before it is written) past the limits.
    pub fn take(&mut self, size: u64) -> Result<(), ImageError> {
        self.files += 1;
        if self.files > self.limits.max_files {
            return Err(self.limits.too_large(
                &self.image,
                format!(
                    "its layers hold more than {} entries",
                    self.limits.max_files
                ),
                format!("{} files, --image-max-files", self.limits.max_files),
            ));
        }
        self.spend(size.saturating_add(ENTRY_COST), "unpack to")
    }

    /// A layer already in the store (unpacked for another image): its compressed size counts,
    /// a lower bound of what it takes.
    pub fn take_cached(&mut self, size: u64) -> Result<(), ImageError> {
        self.spend(size, "take")
    }

    /// `bytes` more, refused past the size limit ("its layers `verb` more than …").
    fn spend(&mut self, bytes: u64, verb: &str) -> Result<(), ImageError> {
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.limits.max_size {
            return Err(self.limits.too_large(
                &self.image,
                format!(
                    "its layers {verb} more than {}",
                    sbx_proto::quantity::human_bytes(self.limits.max_size)
                ),
                self.limits.size_limit(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_counts_bytes_and_entries_and_names_the_limit() {
        let limits = ImageLimits {
            max_layers: 2,
            max_size: 3 * ENTRY_COST,
            max_files: 2,
        };
        let mut b = limits.budget("img");
        b.take(0).unwrap();
        b.take(ENTRY_COST).unwrap();
        let e = b.take(0).unwrap_err().to_string();
        assert!(e.contains("--image-max-files"), "{e}");
        let mut b = limits.budget("img");
        let e = b.take(3 * ENTRY_COST).unwrap_err().to_string();
        assert!(e.contains("--image-max-size"), "{e}");
        let e = limits
            .check_manifest("img", &[1, 1, 1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3 layers") && e.contains("--image-max-layers"),
            "{e}"
        );
        let e = limits
            .check_manifest("img", &[1_000_000_000_000_000])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("claims") && e.contains("--image-max-size"),
            "{e}"
        );
        limits.check_manifest("img", &[10, 20]).unwrap();
    }
}
