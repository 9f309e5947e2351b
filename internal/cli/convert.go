package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

func newConvertCmd(g *globals) *cobra.Command {
	var from, to, modelPath, tokPath, out, config, dtype string
	var random bool
	var seed int64
	cmd := &cobra.Command{
		Use:   "convert",
		Short: "Write an HF model directory: from a llama2.c checkpoint, or with seeded random weights",
		Example: "  mooncake-go convert --from llama2c --to hf --model-path stories260K.bin --tokenizer-path tok512.bin --output out/\n" +
			"  mooncake-go convert --random --config stories110m --output out/",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return errors.New("--output is required")
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return fmt.Errorf("--output: %w", err)
			}
			start := time.Now()
			if random {
				if err := model.WriteRandom(config, out, seed, dtype); err != nil {
					return fmt.Errorf("--config %s: %w (known: %s)", config, err, strings.Join(model.RandomShapes(), ", "))
				}
				tj, cj, err := tokenizer.ByteFallbackHFJSON()
				if err != nil {
					return err
				}
				if err := writeTokenizer(out, tj, cj); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (random %s weights, seed %d) in %v\n", out, config, seed, time.Since(start).Round(time.Millisecond))
				return nil
			}
			if from != "llama2c" {
				return fmt.Errorf("--from %q: only llama2c is supported (or use --random)", from)
			}
			if to != "hf" {
				return fmt.Errorf("--to %q: only hf is supported", to)
			}
			if modelPath == "" || tokPath == "" {
				return errors.New("--model-path and --tokenizer-path are required with --from llama2c")
			}
			m, err := model.LoadLlama2C(modelPath)
			if err != nil {
				return fmt.Errorf("--model-path: %w", err)
			}
			tj, cj, err := tokenizer.Llama2CToHFJSON(tokPath, m.Config.Vocab)
			if err != nil {
				return fmt.Errorf("--tokenizer-path: %w", err)
			}
			if err := model.ConvertLlama2CToHF(modelPath, out, tj, cj); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s in %v\n", out, time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "llama2c", "source format: llama2c")
	f.StringVar(&to, "to", "hf", "target format: hf")
	f.StringVar(&modelPath, "model-path", "", "llama2.c checkpoint")
	f.StringVar(&tokPath, "tokenizer-path", "", "llama2.c tokenizer.bin")
	f.StringVar(&out, "output", "", "output directory")
	f.BoolVar(&random, "random", false, "write seeded random weights of a named shape")
	f.StringVar(&config, "config", "stories110m", "shape for --random: "+strings.Join(model.RandomShapes(), ", "))
	f.StringVar(&dtype, "dtype", "", "weights dtype for --random: float32, float16, bfloat16 (default: the shape's own)")
	f.Int64Var(&seed, "seed", 0, "seed for --random")
	return cmd
}

func writeTokenizer(dir string, tj, cj []byte) error {
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tj, 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), cj, 0o644)
}
